"""Sokoban, Echo's workload: push every box onto a target; the answer is a sequence of moves.

Owned here: ``SokobanTask``, the board generator (deterministic from the id, solvable by construction: every
board is kept only when a breadth-first search solves it), the BFS solver, the move parser and the simulator
that scores an answer.
Called through the registry. Must not import torch.

Board: ``size`` x ``size`` including the wall border (default 6x6: a 4x4 room), ``num_boxes`` boxes (default
2), ``walls`` extra wall cells inside the room. No box starts on a target. Symbols (XSB, with ``_`` for floor
so that no line has meaningful spaces): ``#`` wall, ``_`` floor, ``.`` target, ``$`` box, ``*`` box on
target, ``@`` player, ``+`` player on target.

Answer: moves ``U D L R`` (up, down, left, right). The parser reads, in order, every word made only of the
uppercase letters U/D/L/R (``RRUL``, ``R, R, U``) and the words up/down/left/right in any case; all other
text is ignored (``Done`` is not a move); at most ``max_moves`` moves are read.
Scoring: the moves are simulated from the start; a move into a wall, or pushing a box into a wall or another
box, is ignored (the player stays, the simulation goes on). Reward 1.0 as soon as every box is on a target
(later moves do not matter); otherwise ``partial_credit * boxes on targets at the end / num_boxes``
(default partial_credit 0.5: one of two boxes placed scores 0.25).
"""

from __future__ import annotations

import random
import re
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

from pydantic import Field, model_validator

from echo_p2p.tasks.base import Task, TaskError, TaskOptions

MOVES: dict[str, tuple[int, int]] = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
_MOVE_RE = re.compile(r"(?i:\b(up|down|left|right)\b)|\b([UDLR]+)\b")
_INSTRUCTIONS = (
    "sokoban: push each box $ onto a target . : # wall, _ floor, @ you, * box on target, + you on target. "
    "answer with moves U D L R.\n"
)

Cell = tuple[int, int]


@dataclass(frozen=True)
class Board:
    """A start position: walls, targets, boxes, player (cells are (row, col))."""

    size: int
    walls: frozenset[Cell]
    targets: frozenset[Cell]
    boxes: frozenset[Cell]
    player: Cell

    def render(self) -> str:
        rows = []
        for r in range(self.size):
            line = []
            for c in range(self.size):
                cell = (r, c)
                if cell in self.walls:
                    ch = "#"
                elif cell == self.player:
                    ch = "+" if cell in self.targets else "@"
                elif cell in self.boxes:
                    ch = "*" if cell in self.targets else "$"
                else:
                    ch = "." if cell in self.targets else "_"
                line.append(ch)
            rows.append("".join(line))
        return "\n".join(rows)


def step(board: Board, player: Cell, boxes: frozenset[Cell], move: str) -> tuple[Cell, frozenset[Cell]]:
    """One move; an illegal move leaves the state unchanged."""
    dr, dc = MOVES[move]
    nxt = (player[0] + dr, player[1] + dc)
    if nxt in board.walls:
        return player, boxes
    if nxt in boxes:
        beyond = (nxt[0] + dr, nxt[1] + dc)
        if beyond in board.walls or beyond in boxes:
            return player, boxes
        return nxt, (boxes - {nxt}) | {beyond}
    return nxt, boxes


def solve(board: Board, max_states: int = 200_000) -> str | None:
    """A shortest move sequence that solves ``board`` (breadth-first search), or None if there is none
    (or the search passes ``max_states``)."""
    start = (board.player, board.boxes)
    if board.boxes <= board.targets:
        return ""
    parent: dict[tuple[Cell, frozenset[Cell]], tuple[tuple[Cell, frozenset[Cell]], str] | None] = {
        start: None
    }
    queue = deque([start])
    while queue:
        state = queue.popleft()
        for move in "UDLR":
            nxt = step(board, state[0], state[1], move)
            if nxt == state or nxt in parent:
                continue
            parent[nxt] = (state, move)
            if nxt[1] <= board.targets:
                path = []
                cur: tuple[Cell, frozenset[Cell]] | None = nxt
                while parent[cur] is not None:  # type: ignore[index]
                    prev, mv = parent[cur]  # type: ignore[index,misc]
                    path.append(mv)
                    cur = prev
                return "".join(reversed(path))
            if len(parent) >= max_states:
                return None
            queue.append(nxt)
    return None


def parse_moves(text: str, max_moves: int) -> str:
    """The moves written in ``text`` as a string over ``UDLR`` (see the module docstring)."""
    out: list[str] = []
    for m in _MOVE_RE.finditer(text):
        out.extend(m.group(1)[0].upper() if m.group(1) else m.group(2))
        if len(out) >= max_moves:
            break
    return "".join(out[:max_moves])


def simulate(board: Board, moves: str) -> tuple[bool, int]:
    """(solved at some point, boxes on targets at the end or when solved)."""
    player, boxes = board.player, board.boxes
    for move in moves:
        player, boxes = step(board, player, boxes, move)
        if boxes <= board.targets:
            return True, len(boxes)
    return False, len(boxes & board.targets)


class SokobanOptions(TaskOptions):
    size: int = Field(default=6, ge=5, le=8, description="Board side, wall border included")
    num_boxes: int = Field(default=2, ge=1, le=3, description="Boxes (and targets)")
    walls: int = Field(default=0, ge=0, le=6, description="Extra wall cells inside the room")
    min_solution_len: int = Field(default=4, ge=1, description="Reject boards solved in fewer moves")
    max_solution_len: int = Field(default=16, ge=1, description="Reject boards needing more moves")
    max_moves: int = Field(
        default=64, ge=1, description="Moves of an answer that are simulated (the rest ignored)"
    )
    partial_credit: float = Field(
        default=0.5, ge=0, le=1, description="Reward weight of unsolved box progress"
    )
    instructions: bool = Field(default=True, description="Prefix the board with a one-line rule reminder")
    max_new_tokens: int = Field(default=32, ge=1, description="Completion cap")

    @model_validator(mode="after")
    def _fits(self) -> SokobanOptions:
        room = (self.size - 2) ** 2 - self.walls
        if room < 2 * self.num_boxes + 2:
            raise ValueError(
                f"a {self.size}x{self.size} board with {self.walls} walls has no room for the boxes"
            )
        if self.min_solution_len > self.max_solution_len:
            raise ValueError("min_solution_len > max_solution_len")
        return self


class SokobanTask(Task):
    """Deterministic, BFS-verified Sokoban boards; ids are unbounded (any id in ``0 .. 2**31 - 1``)."""

    name = "sokoban"
    max_attempts = 10_000

    def __init__(self, options: SokobanOptions | None = None) -> None:
        self.options = options or SokobanOptions()
        self.max_new_tokens = self.options.max_new_tokens
        self._generate = lru_cache(maxsize=4096)(self._generate_uncached)

    @property
    def num_prompts(self) -> None:
        return None

    def board(self, prompt_id: int) -> Board:
        return self._generate(self.check_prompt_id(prompt_id))[0]

    def solution(self, prompt_id: int) -> str:
        """A shortest solution (the one the generator's BFS found)."""
        return self._generate(self.check_prompt_id(prompt_id))[1]

    def _generate_uncached(self, prompt_id: int) -> tuple[Board, str]:
        o = self.options
        interior = [(r, c) for r in range(1, o.size - 1) for c in range(1, o.size - 1)]
        border = frozenset(
            (r, c)
            for r in range(o.size)
            for c in range(o.size)
            if r in (0, o.size - 1) or c in (0, o.size - 1)
        )
        for attempt in range(self.max_attempts):
            rng = random.Random(
                f"echo_p2p.sokoban:{o.size}:{o.num_boxes}:{o.walls}:{o.min_solution_len}:"
                f"{o.max_solution_len}:{prompt_id}:{attempt}"
            )
            cells = rng.sample(interior, o.walls + 2 * o.num_boxes + 1)
            inner_walls = cells[: o.walls]
            targets = frozenset(cells[o.walls : o.walls + o.num_boxes])
            boxes = frozenset(cells[o.walls + o.num_boxes : o.walls + 2 * o.num_boxes])
            player = cells[-1]
            board = Board(o.size, border | frozenset(inner_walls), targets, boxes, player)
            moves = solve(board)
            if moves is not None and o.min_solution_len <= len(moves) <= o.max_solution_len:
                return board, moves
        raise TaskError(f"no solvable sokoban board for id {prompt_id} after {self.max_attempts} attempts")

    def prompt(self, prompt_id: int) -> str:
        text = self.board(prompt_id).render() + "\nmoves:"
        return (_INSTRUCTIONS + text) if self.options.instructions else text

    def score(self, prompt_id: int, completion_text: str) -> float:
        board = self.board(prompt_id)
        solved, on_target = simulate(board, parse_moves(completion_text, self.options.max_moves))
        if solved:
            return 1.0
        return self.options.partial_credit * on_target / self.options.num_boxes
