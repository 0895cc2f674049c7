from __future__ import annotations

import pytest

from echo_p2p.tasks.registry import build_task
from echo_p2p.tasks.sokoban import Board, parse_moves, simulate, solve


def test_boards_are_deterministic_and_solvable_by_their_bfs_solution():
    a, b = build_task("sokoban"), build_task("sokoban")
    for i in list(range(40)) + [2**31 - 1]:
        board = a.board(i)
        assert a.prompt(i) == b.prompt(i)
        assert board.size == 6 and len(board.boxes) == 2 and len(board.targets) == 2
        assert not board.boxes & board.targets  # nothing starts solved
        sol = a.solution(i)
        assert 4 <= len(sol) <= 16
        assert solve(board) is not None and len(solve(board)) == len(sol)  # shortest
        assert a.score(i, sol) == 1.0
        assert a.score(i, " ".join(sol)) == 1.0
    assert len({a.prompt(i) for i in range(40)}) == 40


def test_prompt_renders_the_board():
    task = build_task("sokoban")
    text = task.prompt(0)
    grid = text.split("\n")[1:7]
    assert all(len(row) == 6 for row in grid) and grid[0] == "######" and grid[-1] == "######"
    assert sum(row.count("$") for row in grid) == 2 and sum(row.count("@") for row in grid) == 1
    assert text.endswith("moves:")
    bare = build_task("sokoban", {"instructions": False}).prompt(0)
    assert bare.startswith("######") and bare in text


def _corridor() -> Board:
    # ######
    # #@$_.#   one box, target two cells to its right
    # ######
    walls = frozenset({(0, c) for c in range(6)} | {(2, c) for c in range(6)} | {(1, 0), (1, 5)})
    return Board(size=6, walls=walls, targets=frozenset({(1, 4)}), boxes=frozenset({(1, 2)}), player=(1, 1))


def test_simulation_rules():
    board = _corridor()
    assert simulate(board, "RR") == (True, 1)
    assert simulate(board, "R") == (False, 0)
    assert simulate(board, "UUDDRR") == (True, 1)  # moves into walls are ignored
    assert simulate(board, "RRR") == (True, 1)  # solved once is solved; later moves do not matter
    assert simulate(board, "RL") == (False, 0)  # no pulling: the box stays
    assert solve(board) == "RR"


def test_partial_credit_and_wrong_answers():
    task = build_task("sokoban")
    for i in range(20):
        board, sol = task.board(i), task.solution(i)
        assert task.score(i, "") == 0.0
        assert task.score(i, "no idea") == 0.0
        # stop right after the first box lands: 0.5 * 1/2
        for k in range(1, len(sol)):
            solved, on = simulate(board, sol[:k])
            if on == 1 and not solved:
                assert task.score(i, sol[:k]) == pytest.approx(0.25)
                break
    strict = build_task("sokoban", {"partial_credit": 0.0})
    assert strict.score(0, strict.solution(0)[:-1]) == 0.0


@pytest.mark.parametrize(
    ("text", "moves"),
    [
        ("RRUL", "RRUL"),
        ("R, R, U, L", "RRUL"),
        ("up then Left, DOWN right", "ULDR"),
        ("Done. RRX U", "U"),
        ("moves:RDL\n", "RDL"),
        ("", ""),
    ],
)
def test_move_parser(text, moves):
    assert parse_moves(text, max_moves=64) == moves


def test_move_cap():
    assert parse_moves("R" * 100, max_moves=10) == "R" * 10


def test_other_sizes():
    task = build_task("sokoban", {"size": 7, "num_boxes": 2, "walls": 2})
    for i in range(5):
        assert task.score(i, task.solution(i)) == 1.0
        assert len(task.board(i).walls) == 4 * 6 + 2
