"""An upload's rules (protocol/transfer/upload.py, retries.py, verdicts.py) driven directly: facts in, verdicts out."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from protocol.messages import ErrorInfo
from protocol.relay import BUSY, CLOSED, MAX_CHUNK_BYTES, VIOLATION, credit_every
from protocol.transfer import upload, verdicts
from protocol.transfer.retries import PutRetries, Resumes, Step, end_step
from protocol.transfer.upload import Receiver, Window

SIZE = 10 * MAX_CHUNK_BYTES


@dataclass
class Facts:
    """An input as the rules read it (what worker_agent/spool_files.py InputFile holds)."""

    name: str = "in"
    size: int = SIZE
    received: int = 0
    state: str = "receiving"
    busy: bool = False
    mismatch: str = ""
    error: ErrorInfo | None = None


# ---------------------------------------------------------------- the HTTP PUT, from its head


def test_a_put_from_the_acknowledged_offset_within_the_size_is_taken() -> None:
    """None: read the body."""
    assert upload.check_put(Facts(received=4), 4, SIZE - 4, SIZE) is None


@pytest.mark.parametrize(
    ("facts", "offset", "length", "total", "verdict", "says"),
    [
        (Facts(), 0, 5, SIZE + 1, verdicts.SIZE, f"declared {SIZE} bytes, not {SIZE + 1}"),
        (Facts(received=3), 0, 5, SIZE, verdicts.OFFSET, "continues at offset 3, not 0"),
        (Facts(busy=True), 0, 5, SIZE, verdicts.BUSY, "another connection"),
        (Facts(), 0, SIZE + 1, SIZE, verdicts.OVER, f"{SIZE + 1} bytes is over its declared {SIZE}"),
        (Facts(state="verified", received=SIZE), 0, 5, SIZE, verdicts.WHOLE, "already arrived whole"),
    ],
)
def test_a_put_is_refused_from_its_head(facts: Facts, offset: int, length: int, total: int,
                                        verdict: verdicts.Verdict, says: str) -> None:
    """Each refusal names its reason and carries the acknowledged offset (``Upload-Offset``)."""
    answer = upload.check_put(facts, offset, length, total)
    assert answer is not None and answer.verdict is verdict and says in answer.message
    assert answer.offset == facts.received


def test_an_empty_put_of_a_verified_input_is_201() -> None:
    """An input already whole: a PUT with no bytes is answered VERIFIED (201), one with bytes WHOLE (409)."""
    facts = Facts(state="verified", received=SIZE)
    answer = upload.check_put(facts, SIZE, 0, SIZE)
    assert answer is not None and (answer.verdict, answer.status) == (verdicts.VERIFIED, 201)


def test_a_failed_input_says_its_failure_507_for_a_full_disk_else_422() -> None:
    """The input's own error: ``worker_disk_full`` is 507, ``input_mismatch`` 422; relayed, its code."""
    full = Facts(state="failed", error=ErrorInfo(code="worker_disk_full", message="disk full"))
    answer = upload.check_put(full, 0, 5, SIZE)
    assert answer is not None and (answer.status, answer.end_code, answer.message) == (507, "worker_disk_full",
                                                                                        "disk full")
    bad = Facts(state="failed", error=ErrorInfo(code="inputs_unavailable", message="gone"))
    answer = upload.check_put(bad, 0, 5, SIZE)
    assert answer is not None and (answer.status, answer.end_code) == (422, "inputs_unavailable")


# ---------------------------------------------------------------- settling


def test_settled_after_the_last_byte_is_verified_restart_or_the_failure() -> None:
    """Verified: 201 / ""; a mismatch still receiving: RESTART, 409 / relay_closed; failed: its own code."""
    assert upload.settled(Facts(state="verified", received=SIZE)).end_code == ""
    restart = upload.settled(Facts(mismatch="digest x does not match"))
    assert (restart.verdict, restart.status, restart.end_code, restart.message) == (
        verdicts.RESTART, 409, CLOSED, "digest x does not match")
    failed = upload.settled(Facts(state="failed", received=7, error=ErrorInfo(code="input_mismatch", message="m")))
    assert (failed.status, failed.end_code, failed.offset) == (422, "input_mismatch", 7)


def test_complete_when_every_declared_byte_is_stored() -> None:
    """``complete``: the entry may check its digest."""
    assert not upload.complete(Facts(received=SIZE - 1))
    assert upload.complete(Facts(received=SIZE))


# ---------------------------------------------------------------- the relayed receiver


def test_a_relayed_open_of_a_busy_input_is_closed_open_it_again() -> None:
    """Another connection (or a store still running) holds it: BUSY, relay_closed, at its offset."""
    answer = upload.check_open(Facts(busy=True, received=5))
    assert answer is not None and (answer.end_code, answer.offset) == (CLOSED, 5)
    assert upload.check_open(Facts()) is None


def test_relayed_chunks_must_follow_each_other_within_the_size() -> None:
    """Each chunk starts where the last ended; one at another offset or past the size is a violation."""
    rules = Receiver(credit_every(64 * MAX_CHUNK_BYTES), 0)
    facts = Facts()
    assert rules.chunk(facts, 0, MAX_CHUNK_BYTES, storing=False) is None
    assert rules.expected == MAX_CHUNK_BYTES
    late = rules.chunk(facts, 0, MAX_CHUNK_BYTES, storing=False)
    assert late is not None and late.end_code == VIOLATION and f"it continues at {MAX_CHUNK_BYTES}" in late.message
    over = rules.chunk(facts, MAX_CHUNK_BYTES, SIZE, storing=False)
    assert over is not None and over.end_code == VIOLATION


def test_a_relayed_chunk_while_a_direct_upload_writes_is_busy_but_not_while_its_own_store_does() -> None:
    """``busy`` from another connection ends the stream; from this upload's own store it does not."""
    rules = Receiver(MAX_CHUNK_BYTES, 0)
    busy = rules.chunk(Facts(busy=True), 0, 10, storing=False)
    assert busy is not None and busy.verdict is verdicts.BUSY
    assert rules.chunk(Facts(busy=True), 0, 10, storing=True) is None


def test_credits_go_once_per_quarter_window_not_per_chunk() -> None:
    """Stored bytes are credited when a quarter window more is stored; the last byte is settled, not credited."""
    window = 64 * MAX_CHUNK_BYTES
    every = credit_every(window)
    rules = Receiver(every, 0)
    facts = Facts(size=window)
    credits = []
    for _ in range(window // MAX_CHUNK_BYTES):
        facts.received += MAX_CHUNK_BYTES
        credits.append(rules.stored(facts))
    assert [c for c in credits if c is not None] == [every, 2 * every, 3 * every]
    assert rules.batch(facts) >= 1


# ---------------------------------------------------------------- the sender's window


def test_the_window_lets_a_chunk_go_only_when_all_of_it_fits() -> None:
    """``window - (sent - acked)`` must hold the whole chunk; a credit moves ``acked`` forward only."""
    window = Window(SIZE, 0, 2 * MAX_CHUNK_BYTES)
    assert window.next_length(0) == MAX_CHUNK_BYTES
    assert window.next_length(MAX_CHUNK_BYTES) == MAX_CHUNK_BYTES
    assert window.next_length(2 * MAX_CHUNK_BYTES) == 0  # wait for credit
    assert window.credit(MAX_CHUNK_BYTES, 2 * MAX_CHUNK_BYTES)
    assert not window.credit(0, 2 * MAX_CHUNK_BYTES)  # behind the last
    assert not window.credit(3 * MAX_CHUNK_BYTES, 2 * MAX_CHUNK_BYTES)  # past what was sent
    assert window.next_length(2 * MAX_CHUNK_BYTES) == MAX_CHUNK_BYTES
    assert window.next_length(SIZE) == 0  # all sent


# ---------------------------------------------------------------- the SDK's retries


def test_put_answers_done_again_or_fail_503_from_zero_after_a_wait() -> None:
    """200/201 done; 204 and 409 again at once, asking the offset; 503 again after a wait, unasked; 422 fails."""
    retries = PutRetries(8)
    assert retries.answered(201).action == "done"
    assert retries.answered(204) == retries.answered(409) == Step("again")
    step = retries.answered(503)
    assert (step.action, step.ask) == ("again", False) and step.wait_s == min(2.0, 0.25 * 2**3)
    assert retries.answered(422).action == "fail"


def test_put_answers_past_max_resumes_fail() -> None:
    """Every 204/409/503 counts: the ninth of max_resumes=8 fails with its status."""
    retries = PutRetries(8)
    assert [retries.answered(409).action for _ in range(9)] == ["again"] * 8 + ["fail"]


def test_breaks_back_off_and_a_run_that_moved_bytes_counts_from_one() -> None:
    """``min(2, 0.05 * 2**n)`` per break in a row; a progressed break is the first of a new run."""
    resumes = Resumes(3)
    assert [resumes.broke() for _ in range(3)] == [0.1, 0.2, 0.4]
    assert resumes.broke(progressed=True) == 0.1
    assert [resumes.broke() for _ in range(3)] == [0.2, 0.4, None]


@pytest.mark.parametrize(
    ("code", "done_ok", "step"),
    [(CLOSED, True, ("retry", 0)), (BUSY, False, ("retry", 0)), ("", True, ("done", 0)), ("", False, ("retry", 0)),
     ("unauthorized", True, ("fail", 401)), ("forbidden", True, ("fail", 403)), ("output_gone", False, ("fail", 404)),
     ("input_mismatch", True, ("fail", 422)), ("worker_disk_full", True, ("fail", 507)),
     (VIOLATION, True, ("fail", 400)), ("cancelled", True, ("fail", 0))],
)
def test_a_relayed_end_is_retried_done_or_failed_with_the_direct_paths_status(
        code: str, done_ok: bool, step: tuple[str, int]) -> None:
    """The one table: a data_end code reads back as the status the direct path would have answered."""
    assert end_step(code, done_ok=done_ok) == step


def test_every_verdict_is_in_the_table_once_with_its_status_and_code() -> None:
    """verdicts.TABLE lists each verdict once; its HTTP statuses are 0 or real ones."""
    assert len({v.name for v in verdicts.TABLE}) == len(verdicts.TABLE)
    assert all(v.status == 0 or 200 <= v.status < 600 for v in verdicts.TABLE)
