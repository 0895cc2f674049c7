"""Rate-limited log lines (``logs.RateLimitedLog``): the first at once, then one per period with a count."""

from __future__ import annotations

import logging

from echo_p2p.logs import RateLimitedLog


def test_a_repeated_line_is_logged_once_per_period_with_how_many_it_stands_for(caplog):
    now = [100.0]
    log = RateLimitedLog(logging.getLogger("tests.ratelimit"), period=10.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="tests.ratelimit")
    logged = []
    for _ in range(812):  # one a millisecond... all within the first window but the first
        logged.append(log.warning("dup", "rejected rollout %s: duplicate_content", "r1"))
        now[0] += 0.01
    assert logged.count(True) == 1 and logged[0]
    now[0] = 100.0 + 10.0
    assert log.warning("dup", "rejected rollout %s: duplicate_content", "r2")
    assert log.info("other", "another key is not held back")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "rejected rollout r1: duplicate_content",
        "rejected rollout r2: duplicate_content (x 812 in the last 10 s)",  # 811 held back + this one
        "another key is not held back",
    ]
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.WARNING, logging.INFO]


def test_the_count_can_be_worded_and_a_line_after_a_quiet_period_has_no_count(caplog):
    now = [0.0]
    log = RateLimitedLog(
        logging.getLogger("tests.ratelimit"), 5.0, "{n} versions applied in {seconds:.0f} s", lambda: now[0]
    )
    caplog.set_level(logging.INFO, logger="tests.ratelimit")
    for version in range(21):  # 4 versions a second
        log.info("applied", "applied version %d", version)
        now[0] += 0.25
    now[0] = 60.0
    log.info("applied", "applied version %d", 99)  # one event after a long pause: nothing held back
    assert [r.getMessage() for r in caplog.records] == [
        "applied version 0",
        "applied version 20 (20 versions applied in 5 s)",
        "applied version 99",
    ]


def test_a_disabled_level_neither_logs_nor_counts(caplog):
    log = RateLimitedLog(logging.getLogger("tests.ratelimit"), 10.0, clock=lambda: 0.0)
    caplog.set_level(logging.INFO, logger="tests.ratelimit")
    assert not log.log(logging.DEBUG, "k", "hidden")
    assert log.info("k", "shown") and [r.getMessage() for r in caplog.records] == ["shown"]


def test_per_logger_levels_from_the_environment_apply_over_the_process_level(monkeypatch):
    """``ECHO_LOG_LEVELS`` opens one component to DEBUG (hivemind's matchmaking logs only there) while the
    rest of hivemind stays at WARNING; an entry that is not LOGGER=LEVEL is refused with a line, not applied."""
    from echo_p2p.logs import LEVELS_ENV, parse_log_levels, setup_logging

    assert parse_log_levels(" a.b=debug,, c = WARNING ,d=LOUD,e,=INFO") == (
        {"a.b": "DEBUG", "c": "WARNING"},
        ["d=LOUD", "e", "=INFO"],
    )
    names = ("hivemind", "hivemind.averaging", "tests.levels")
    saved = {name: logging.getLogger(name).level for name in names}
    root = logging.getLogger("echo_p2p")  # setup_logging gives it a handler of its own, not propagated
    saved_root = (root.level, root.propagate, list(root.handlers))
    monkeypatch.setenv(LEVELS_ENV, "hivemind.averaging=DEBUG,tests.levels=ERROR,tests.levels.x=LOUD")
    monkeypatch.setenv("HIVEMIND_LOGLEVEL", "WARNING")
    warned: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("echo_p2p.logs").addHandler(catch)
    try:
        setup_logging("INFO")
        matchmaking = logging.getLogger("hivemind.averaging.matchmaking")
        assert matchmaking.getEffectiveLevel() == logging.DEBUG
        assert logging.getLogger("hivemind.dht").getEffectiveLevel() == logging.WARNING
        assert logging.getLogger("tests.levels").level == logging.ERROR
        assert logging.getLogger("tests.levels.x").level == logging.NOTSET  # refused: not applied
        assert warned == [
            f"{LEVELS_ENV}: ignoring 'tests.levels.x=LOUD' (want LOGGER=LEVEL, LEVEL one of DEBUG, INFO, "
            "WARNING, ERROR, CRITICAL)"
        ]
    finally:
        logging.getLogger("echo_p2p.logs").removeHandler(catch)
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
        root.setLevel(saved_root[0])
        root.propagate = saved_root[1]
        root.handlers[:] = saved_root[2]
