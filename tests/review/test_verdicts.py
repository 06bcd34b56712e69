"""``vit_ct.review.verdicts``: a reviewer's verdicts CSV kept whole with several writers (objects, threads, processes),
reviewer names made safe as file names, one row per case (the later row wins) in the summary and the comparison, and
a broken file refused by name. Summaries and kappa are checked against values computed by hand."""

from __future__ import annotations

import multiprocessing
import threading

import pandas as pd
import pytest

from vit_ct import review
from vit_ct.review.verdicts import COLUMNS, Verdicts, read_verdicts

HEADER = ",".join(COLUMNS)


def write_csv(path, *rows: str) -> None:
    path.write_text("\n".join([HEADER, *rows]) + "\n", encoding="utf-8")


# --- several writers on one file --------------------------------------------------------------------------------------


def test_two_writers_in_one_process_keep_each_others_verdicts(tmp_path):
    path = tmp_path / "verdicts.csv"
    a = Verdicts(path, "alice")
    a.record("s1", map="on the lesion")
    b = Verdicts(path, "alice")  # the notebook cell run a second time
    b.record("s2", label="agree")
    a.record("s3", map="elsewhere")
    assert a.get("s2")["label"] == "agree"  # what the other writer recorded, seen at once
    b.record("s1", note="small bleed")  # a field not given keeps the value on disk (a's map)
    a.record("s2", map="near it")
    on_disk = read_verdicts(path).set_index("case")
    assert sorted(on_disk.index) == ["s1", "s2", "s3"]
    assert on_disk.loc["s1", "map"] == "on the lesion" and on_disk.loc["s1", "note"] == "small bleed"
    assert on_disk.loc["s2", "map"] == "near it" and on_disk.loc["s2", "label"] == "agree"
    assert on_disk.loc["s3", "map"] == "elsewhere" and (on_disk["reviewer"] == "alice").all()
    assert a.frame.equals(b.frame)  # both read what is on disk now
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["verdicts.csv"]


def test_a_listener_sees_each_verdict_on_disk_and_a_failing_one_undoes_nothing(tmp_path):
    path = tmp_path / "verdicts.csv"
    verdicts = Verdicts(path, "alice")
    seen = []
    lock = tmp_path / ".verdicts.csv.lock"
    verdicts.on_record(lambda case: seen.append((case, read_verdicts(path)["case"].tolist(), _free(lock))))
    verdicts.record("s1", map="on the lesion")
    verdicts.record("s2", label="agree")
    assert seen == [("s1", ["s1"], True), ("s2", ["s1", "s2"], True)]  # written, the lock released, then told

    def broken(case):
        raise RuntimeError(f"the summary of {case} failed to draw")

    verdicts.on_record(broken)
    with pytest.raises(RuntimeError, match="s3"):
        verdicts.record("s3", map="elsewhere")
    assert read_verdicts(path)["case"].tolist() == ["s1", "s2", "s3"]  # the verdict stays written
    Verdicts(path, "alice").record("s4", map="near it")  # another writer's verdicts tell this one's listeners nothing
    assert [case for case, *_ in seen] == ["s1", "s2", "s3"]


def _free(lock) -> bool:
    from filelock import FileLock, Timeout

    try:
        with FileLock(lock, timeout=0):
            return True
    except Timeout:
        return False


def test_threads_writing_at_once_lose_nothing(tmp_path):
    path = tmp_path / "verdicts.csv"
    start = threading.Barrier(3)  # two writers and this thread, which lets them go together

    def write(prefix: str, map_verdict: str) -> None:
        verdicts = Verdicts(path, "alice")
        start.wait()
        for i in range(25):
            verdicts.record(f"{prefix}{i}", map=map_verdict)
            verdicts.record(f"shared{i}", **({"map": map_verdict} if prefix == "a" else {"label": "disagree"}))

    threads = [threading.Thread(target=write, args=args) for args in (("a", "near it"), ("b", "elsewhere"))]
    for thread in threads:
        thread.start()
    start.wait()
    for thread in threads:
        thread.join()
    on_disk = read_verdicts(path).set_index("case")
    assert len(on_disk) == 75 and on_disk.index.is_unique
    assert (on_disk.loc[[f"a{i}" for i in range(25)], "map"] == "near it").all()
    assert (on_disk.loc[[f"b{i}" for i in range(25)], "map"] == "elsewhere").all()
    shared = on_disk.loc[[f"shared{i}" for i in range(25)]]  # both writers' fields merged on each shared case
    assert (shared["map"] == "near it").all() and (shared["label"] == "disagree").all()


def _write_in_a_process(path, prefix, map_verdict, start, count):
    verdicts = Verdicts(path, "alice")
    start.wait()
    for i in range(count):
        verdicts.record(f"{prefix}{i}", map=map_verdict)
        verdicts.record(f"shared{i}", **({"map": map_verdict} if prefix == "p" else {"label": "disagree"}))


@pytest.mark.medium
@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork (Linux, macOS)")
def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    """Forked, so the workers start without importing vit_ct again; each has its own file handles and lock."""
    path, count = tmp_path / "verdicts.csv", 40
    context = multiprocessing.get_context("fork")
    start = context.Barrier(2)
    workers = [
        context.Process(target=_write_in_a_process, args=(path, prefix, map_verdict, start, count))
        for prefix, map_verdict in (("p", "near it"), ("q", "elsewhere"))
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0]
    on_disk = read_verdicts(path).set_index("case")
    assert len(on_disk) == 3 * count and on_disk.index.is_unique
    assert (on_disk.loc[[f"p{i}" for i in range(count)], "map"] == "near it").all()
    assert (on_disk.loc[[f"q{i}" for i in range(count)], "map"] == "elsewhere").all()
    shared = on_disk.loc[[f"shared{i}" for i in range(count)]]
    assert (shared["map"] == "near it").all() and (shared["label"] == "disagree").all()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


def test_verdict_summary_and_two_reviewers_by_hand(tmp_path):
    a, b = review.Verdicts(tmp_path / "a.csv", "a"), review.Verdicts(tmp_path / "b.csv", "b")
    for case, (map_a, label_a, map_b, label_b) in {
        "s1": ("on the lesion", "agree", "on the lesion", "agree"),
        "s2": ("near it", "agree", "on the lesion", "agree"),
        "s3": ("elsewhere", "disagree", "elsewhere", "agree"),
        "s4": ("no lesion visible", "agree", "no lesion visible", "agree"),
    }.items():
        a.record(case, map=map_a, label=label_a)
        b.record(case, map=map_b, label=label_b)
    summary = review.verdict_summary(a.frame)
    assert summary["cases"] == 4 and summary["label_agreement"] == 0.75
    assert summary["pointing"] == pytest.approx(1 / 3) and summary["pointing_near"] == pytest.approx(2 / 3)
    assert summary["disputed"] == ["s3"]
    compared = review.compare_reviewers(tmp_path / "a.csv", tmp_path / "b.csv")
    assert compared.loc["map", "agreement"] == 0.75 and compared.loc["map", "differ"] == ["s2"]
    # kappa by hand: observed 3/4; chance sum over categories of p_a * p_b = (1/4)(2/4) + (1/4)(0) + (1/4)(1/4) * 2
    assert compared.loc["map", "kappa"] == pytest.approx((0.75 - 0.25) / (1 - 0.25))
    assert compared.loc["label", "agreement"] == 0.75
    with pytest.raises(ValueError, match="map verdict"):
        a.record("s5", map="maybe")


# --- reviewer names as file names ------------------------------------------------------------------------------------


def test_a_plain_reviewer_name_keeps_its_file_name(tmp_path):
    assert review.verdicts_path(tmp_path, "reader-1") == tmp_path / "verdicts-reader-1.csv"
    assert review.verdicts_path(tmp_path, "Dr.Smith_2") == tmp_path / "verdicts-Dr.Smith_2.csv"


@pytest.mark.parametrize("reviewer", ["dr/smith", "../../escape", "..", "a\\b", "/etc/passwd", "ana maría", "x" * 300])
def test_a_reviewer_name_never_leaves_the_review_folder(tmp_path, reviewer):
    folder = tmp_path / "review"
    path = review.verdicts_path(folder, reviewer)
    assert path.parent == folder and path.name.startswith("verdicts-") and path.suffix == ".csv"
    assert len(path.name) <= 120  # far below the 255 bytes a file name may have
    verdicts = Verdicts(path, reviewer)
    verdicts.record("s1", map="near it")
    assert [p.name for p in folder.iterdir() if not p.name.startswith(".")] == [path.name]  # no subfolder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["review"]  # nothing outside it
    assert read_verdicts(path)["reviewer"].tolist() == [reviewer]  # the name as typed


def test_different_reviewer_names_never_share_a_file(tmp_path):
    names = ["dr/smith", "dr_smith", "dr\\smith", "dr smith", "dr:smith", "../dr_smith"]
    paths = {review.verdicts_path(tmp_path, name) for name in names}
    assert len(paths) == len(names)
    assert review.verdicts_path(tmp_path, "dr/smith") == review.verdicts_path(tmp_path, "dr/smith")  # stable


@pytest.mark.parametrize("reviewer", ["", "   ", "\t\n"])
def test_a_blank_reviewer_name_is_refused(tmp_path, reviewer):
    with pytest.raises(ValueError, match="reviewer"):
        review.verdicts_path(tmp_path, reviewer)
    with pytest.raises(ValueError, match="reviewer"):
        Verdicts(tmp_path / "verdicts.csv", reviewer)


# --- one row per case: the later row wins ----------------------------------------------------------------------------


@pytest.fixture
def corrected(tmp_path):
    """Reviewer a's file with s2 corrected by hand in a second row, and reviewer b's."""
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    write_csv(
        a,
        "s1,a,on the lesion,agree,,2026-01-01T10:00:00+00:00",
        "s2,a,elsewhere,disagree,first look,2026-01-01T10:01:00+00:00",
        "s3,a,near it,agree,,2026-01-01T10:02:00+00:00",
        "s2,a,on the lesion,agree,looked again,2026-01-01T09:00:00+00:00",  # later in the file, earlier in time
    )
    write_csv(
        b,
        "s1,b,on the lesion,agree,,2026-01-02T10:00:00+00:00",
        "s2,b,on the lesion,agree,,2026-01-02T10:00:00+00:00",
        "s3,b,elsewhere,disagree,,2026-01-02T10:00:00+00:00",
    )
    return a, b


def test_a_corrected_row_replaces_the_earlier_one(corrected):
    a, _ = corrected
    frame = read_verdicts(a)
    assert frame["case"].tolist() == ["s1", "s3", "s2"]  # one row each; the later row in the file wins
    assert frame.set_index("case").loc["s2", ["map", "label", "note"]].tolist() == ["on the lesion", "agree",
                                                                                    "looked again"]  # fmt: skip
    assert Verdicts(a, "a").get("s2")["note"] == "looked again"


def test_summary_and_kappa_count_a_corrected_case_once(corrected):
    a, b = corrected
    summary = review.verdict_summary(read_verdicts(a))
    # by hand, after the correction: s1 on / agree, s2 on / agree, s3 near / agree
    assert summary["cases"] == 3 and summary["label_agreement"] == 1.0
    assert summary["pointing"] == pytest.approx(2 / 3) and summary["pointing_near"] == 1.0
    assert summary["disputed"] == [] and summary["map_verdicts"]["elsewhere"] == 0
    compared = review.compare_reviewers(a, b)
    assert compared.loc["map", "cases"] == 3 and compared.loc["map", "differ"] == ["s3"]
    # map: a (on, on, near) vs b (on, on, elsewhere): observed 2/3; chance (2/3)(2/3) = 4/9 ("on" only is shared)
    assert compared.loc["map", "agreement"] == pytest.approx(2 / 3)
    assert compared.loc["map", "kappa"] == pytest.approx((2 / 3 - 4 / 9) / (1 - 4 / 9))  # 0.4
    # label: a (agree x3) vs b (agree, agree, disagree): observed 2/3; chance 1 x 2/3 = 2/3, so kappa 0
    assert compared.loc["label", "agreement"] == pytest.approx(2 / 3)
    assert compared.loc["label", "kappa"] == pytest.approx(0.0)


def test_recording_over_a_corrected_file_leaves_one_row(corrected):
    a, _ = corrected
    Verdicts(a, "a").record("s2", label="disagree")
    frame = read_verdicts(a)
    assert (pd.read_csv(a)["case"] == "s2").sum() == 1
    s2 = frame.set_index("case").loc["s2"]
    assert (s2["map"], s2["label"], s2["note"]) == ("on the lesion", "disagree", "looked again")


def test_a_file_of_two_reviewers_is_refused(tmp_path):
    path = tmp_path / "pooled.csv"
    write_csv(path, "s1,a,on the lesion,agree,,", "s1,b,elsewhere,agree,,")
    with pytest.raises(ValueError, match=r"pooled\.csv.*\['a', 'b'\]"):
        read_verdicts(path)


# --- a broken file ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, problem",
    [
        (f"{HEADER}\ns1,a,on the lesion,agree,a note, with commas,2026-01-01\n", "line 2"),  # an unquoted comma
        (f'{HEADER}\ns1,a,on the lesion,agree,"an open quote,2026-01-01\n', "EOF"),
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe binary", "UTF-8"),
        ("", "empty"),
    ],
)
def test_an_unreadable_verdicts_file_is_named_and_kept(tmp_path, content, problem):
    path = tmp_path / "verdicts-a.csv"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    before = path.read_bytes()
    with pytest.raises(ValueError, match=rf"verdicts-a\.csv.*{problem}.*case, reviewer, map, label, note, time"):
        read_verdicts(path)
    with pytest.raises(ValueError, match=r"verdicts-a\.csv"):
        Verdicts(path, "a")
    assert path.read_bytes() == before  # nothing written over it


def test_a_file_saved_by_a_spreadsheet_with_a_byte_order_mark_reads(tmp_path):
    path = tmp_path / "verdicts-a.csv"
    path.write_bytes(("\ufeff" + HEADER + "\ns1,a,near it,agree,,\n").encode("utf-8"))
    assert read_verdicts(path).loc[0, ["case", "map"]].tolist() == ["s1", "near it"]


def test_a_writer_that_holds_the_lock_too_long_is_named_and_nothing_is_written(tmp_path, monkeypatch):
    from filelock import FileLock

    from vit_ct.review import verdicts as verdicts_module

    path = tmp_path / "verdicts-a.csv"
    Verdicts(path, "a").record("s1", map="near it")
    before = path.read_bytes()
    monkeypatch.setattr(verdicts_module, "LOCK_TIMEOUT_S", 0.2)
    held = FileLock(tmp_path / ".verdicts-a.csv.lock")  # a stopped writer holding it
    with held, pytest.raises(TimeoutError, match=r"verdicts-a\.csv\.lock.*s2"):
        Verdicts(path, "a").record("s2", map="elsewhere")
    assert path.read_bytes() == before
    Verdicts(path, "a").record("s2", map="elsewhere")  # released: written
    assert read_verdicts(path)["case"].tolist() == ["s1", "s2"]
