"""A resume never shortens metrics.jsonl silently: cut at any byte, the log keeps every whole row
the checkpoint covers, and the rows it lost are said in one line and recorded as a gap."""

import json

from meshfold.train.metrics_log import resume_metrics, write_row


def logged(path, steps):
    with open(path, "w") as f:
        for n in steps:
            write_row(f, {"step": n, "loss": 4.0 - n / 100, "tokens_per_expert": [[n, 8 - n]]})
    return path.read_bytes()


def test_a_log_cut_at_every_byte_of_its_last_two_rows_keeps_whole_rows_and_records_the_gap(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = logged(path, range(1, 9))  # a checkpoint at step 8 covers all eight rows
    last_two = whole.rindex(b"\n", 0, whole.rindex(b"\n", 0, len(whole) - 1)) + 1
    for cut in range(last_two, len(whole) + 1):
        path.write_bytes(whole[:cut])
        note = resume_metrics(path, 8, skipped=0, checkpoint="step_000008")
        rows = [json.loads(line) for line in path.read_text().splitlines()]  # every line parses
        assert path.read_bytes().endswith(b"\n")
        trained = [r["step"] for r in rows if "gap" not in r]
        gaps = [r["gap"] for r in rows if "gap" in r]
        intact = whole[:cut].count(b"\n") + (whole[cut:cut + 1] == b"\n")  # (a row whole but for its newline)
        assert trained == list(range(1, intact + 1)), cut
        if intact == 8:
            assert note is None and gaps == [], cut
        else:
            assert gaps == [[intact + 1, 8]], cut
            assert note is not None and "\n" not in note and f"steps {intact + 1}-8" in note, cut
            assert "step_000008" in note and "gap" in note


def test_a_repaired_log_is_left_alone_by_the_next_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = logged(path, range(1, 9))
    path.write_bytes(whole[:-5])
    assert resume_metrics(path, 8, skipped=0) is not None
    repaired = path.read_bytes()
    assert resume_metrics(path, 8, skipped=0) is None and path.read_bytes() == repaired
    with open(path, "a") as f:  # the resumed run goes on: steps 9-10, then a resume at 10
        for n in (9, 10):
            write_row(f, {"step": n, "loss": 1.0})
    assert resume_metrics(path, 10, skipped=0) is None
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [*range(1, 8), 8, 9, 10]


def test_rows_after_the_checkpoint_go_without_a_note_and_skipped_steps_are_no_gap(tmp_path):
    path = tmp_path / "metrics.jsonl"
    whole = logged(path, [1, 2, 4, 5, 6, 7, 8])  # step 3 was skipped (non-finite loss)
    path.write_bytes(whole[:-3])  # row 8 torn: after the checkpoint at 6, so nothing is lost
    assert resume_metrics(path, 6, skipped=1) is None
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 4, 5, 6]
