"""Cross-validation folds: in the store (preprocess, `ctseg folds`), training one fold,
and the cross-validation evaluation of one run per fold."""

import json
import random
import re
import shutil
from pathlib import Path

import pytest
from helpers import prepare_store, tiny_config
from typer.testing import CliRunner

import ctseg.cli.main  # noqa: F401  (registers the commands)
from ctseg.cli.app import app
from ctseg.data.store import Store
from ctseg.data_prep.splits import assign_folds, write_folds
from ctseg.errors import CtsegError
from ctseg.evaluation.cross_validation import evaluate_cross_validation
from ctseg.evaluation.runs import evaluate_run
from ctseg.run import evaluations, rundir
from ctseg.synth.dataset import write_dataset
from ctseg.training import pipeline, validation
from ctseg.training.loop import train_and_evaluate

runner = CliRunner()
RUN = ("train.steps=2", "train.eval_every=2", "train.checkpoint_every=2", "train.log_every=1")


def _store_files(store_dir: Path) -> dict[str, tuple[int, bytes]]:
    """Every file of the store but its manifest and lock: path -> (mtime, bytes)."""
    return {
        str(p.relative_to(store_dir)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(store_dir.rglob("*"))
        if p.is_file() and p.name not in ("manifest.json", ".ctseg-lock")
    }


def _manifest(store_dir: Path) -> dict:
    return json.loads((store_dir / "manifest.json").read_text())


def _folds_of(store: Store) -> dict[str, int | None]:
    return {case.id: case.fold for case in store.cases}


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    out = tmp_path_factory.mktemp("raw")
    write_dataset(out, cases=5, size=24, seed=2)
    return out


# ---------------------------------------------------------------- folds in the store


@pytest.mark.parametrize(
    ("count", "folds"), [(2, 2), (5, 5), (7, 3), (10, 5), (11, 2), (11, 3), (13, 5)]
)
def test_folds_are_deterministic_balanced_and_cover_every_case_once(count, folds):
    ids = [f"lits-{i}" for i in range(count)]
    assigned = assign_folds(ids, folds, seed=4)
    assert assigned == assign_folds(ids, folds, seed=4)
    shuffled = ids[:]
    random.Random(0).shuffle(shuffled)
    assert assign_folds(shuffled, folds, seed=4) == assigned  # the listing order is no matter
    assert sorted(assigned) == sorted(ids)  # every case in exactly one fold
    sizes = [list(assigned.values()).count(f) for f in range(folds)]
    assert set(assigned.values()) == set(range(folds)) and max(sizes) - min(sizes) <= 1
    if count >= 7:
        assert any(assign_folds(ids, folds, seed=s) != assigned for s in range(5, 9))


def test_preprocess_assigns_folds_and_a_rerun_keeps_them(raw, tmp_path):
    prep = tmp_path / "prep"
    result = prepare_store(raw, prep, tiny_config("data.folds=3", "data.split_seed=7"))
    store = result.store
    ids = [case.id for case in store.cases]
    assert (store.folds, store.fold_seed) == (3, 7)
    assert _folds_of(store) == assign_folds(ids, 3, 7)
    manifest = _manifest(prep)
    assert (manifest["folds"], manifest["fold_seed"], manifest["version"]) == (3, 7, 1)
    assert {c["id"]: c["fold"] for c in manifest["cases"]} == assign_folds(ids, 3, 7)
    # The folds are independent of the train/val split (both labelled: both in folds).
    assert {case.split for case in store.cases} == {"train", "val"}

    arrays = _store_files(prep / "cases")
    again = prepare_store(raw, prep, tiny_config("data.folds=3", "data.split_seed=7"))
    assert [o.status for o in again.outcomes] == ["resumed"] * 5
    assert _folds_of(again.store) == _folds_of(store)
    # data.folds = 0 (the default) keeps the store's folds, seed and all.
    kept = prepare_store(raw, prep, tiny_config()).store
    assert (kept.folds, kept.fold_seed, _folds_of(kept)) == (3, 7, _folds_of(store))
    assert _store_files(prep / "cases") == arrays

    with pytest.raises(CtsegError, match=r"has 3 folds \(seed 7\).*ctseg folds \(2 folds, seed 7"):
        prepare_store(raw, prep, tiny_config("data.folds=2", "data.split_seed=7"))
    assert Store.open(prep) == kept  # refused before anything was written
    with pytest.raises(CtsegError, match="data.folds = 6 needs at least 6 labelled cases"):
        prepare_store(raw, tmp_path / "other", tiny_config("data.folds=6"))


def test_folds_are_drawn_again_with_a_warning_when_the_labelled_cases_change(raw, tmp_path):
    folder = tmp_path / "raw"
    folder.mkdir()
    for i in range(4):
        for name in (f"volume-{i}.nii.gz", f"segmentation-{i}.nii.gz"):
            shutil.copy(raw / name, folder / name)
    prep, warnings = tmp_path / "prep", []
    first = prepare_store(folder, prep, tiny_config("data.folds=2"), warn=warnings.append).store
    assert warnings == [] and sorted(_folds_of(first).values()) == [0, 0, 1, 1]
    shutil.copy(raw / "volume-4.nii.gz", folder)  # its label comes later: the case fails
    prepare_store(folder, prep, tiny_config(), warn=warnings.append)
    assert warnings == [] and _folds_of(Store.open(prep)) == _folds_of(first)
    shutil.copy(raw / "segmentation-4.nii.gz", folder)
    second = prepare_store(folder, prep, tiny_config(), warn=warnings.append).store
    assert _folds_of(second) == assign_folds([f"lits-{i}" for i in range(5)], 2, 0)
    assert len(warnings) == 1 and "changed since its 2 folds were drawn" in warnings[0]
    forced = prepare_store(
        folder, prep, tiny_config("data.folds=3"), force=True, warn=warnings.append
    )
    assert forced.store.folds == 3 and "2 folds (seed 0) of" in warnings[1]
    assert "were replaced by 3 folds (seed 0)" in warnings[1]


def test_fewer_labelled_cases_than_folds_leave_the_store_without_folds(raw, tmp_path):
    folder = tmp_path / "raw"
    folder.mkdir()
    for name in ("volume-0.nii.gz", "segmentation-0.nii.gz", "volume-1.nii.gz"):
        shutil.copy(raw / name, folder / name)
    warnings = []
    result = prepare_store(
        folder, tmp_path / "prep", tiny_config("data.folds=2"), warn=warnings.append
    )
    assert [f.case_id for f in result.failures] == ["lits-1"]
    assert result.store.folds == 0 and result.store.case("lits-0").fold is None
    assert len(warnings) == 1 and "fewer than 2 folds" in warnings[0]


def test_folds_command_rewrites_only_the_manifest(raw, tmp_path):
    prep = tmp_path / "prep"
    store = prepare_store(raw, prep, tiny_config()).store
    assert store.folds == 0 and set(_folds_of(store).values()) == {None}
    before = _store_files(prep)
    splits = {case.id: case.split for case in store.cases}

    result = runner.invoke(app, ["folds", str(prep), "--k", "3"])
    assert result.exit_code == 0, result.output
    assert "3 folds (seed 0) of 5 labelled case(s) written" in " ".join(result.output.split())
    after = Store.open(prep)
    ids = list(splits)
    assert (after.folds, after.fold_seed) == (3, 0)
    assert _folds_of(after) == assign_folds(ids, 3, 0)
    assert {case.id: case.split for case in after.cases} == splits
    assert _store_files(prep) == before  # arrays and case.json untouched, to the byte and mtime
    # The same folds as preprocess would have assigned with data.folds = 3.
    fresh = prepare_store(raw, tmp_path / "fresh", tiny_config("data.folds=3")).store
    assert _folds_of(fresh) == _folds_of(after)

    manifest = (prep / "manifest.json").read_bytes()
    same = runner.invoke(app, ["folds", str(prep), "--k", "3"])
    assert same.exit_code == 0 and "left as it was" in same.output
    other = runner.invoke(app, ["folds", str(prep), "--k", "2"])
    assert isinstance(other.exception, CtsegError)
    assert "already has 3 folds (seed 0)" in str(other.exception)
    assert "--force" in str(other.exception)
    assert (prep / "manifest.json").read_bytes() == manifest
    forced = runner.invoke(app, ["folds", str(prep), "--k", "2", "--seed", "1", "--force"])
    assert forced.exit_code == 0, forced.output
    assert _folds_of(Store.open(prep)) == assign_folds(ids, 2, 1)
    removed = runner.invoke(app, ["folds", str(prep), "--k", "0", "--force"])
    assert removed.exit_code == 0, removed.output
    assert Store.open(prep).folds == 0 and _manifest(prep)["fold_seed"] is None
    assert _store_files(prep) == before

    for args, message in [
        (["--k", "1"], "--k must be 0 (no folds) or at least 2"),
        (["--k", "6"], "--k 6 needs at least 6 labelled cases"),
    ]:
        bad = runner.invoke(app, ["folds", str(prep), *args])
        assert isinstance(bad.exception, CtsegError) and message in str(bad.exception)
    missing = runner.invoke(app, ["folds", str(tmp_path / "nowhere"), "--k", "2"])
    assert "no prepared store" in str(missing.exception)
    assert not (tmp_path / "nowhere").exists()


def test_an_older_manifest_without_folds_still_reads(raw, tmp_path):
    prep = tmp_path / "prep"
    prepare_store(raw, prep, tiny_config("data.folds=2"))
    manifest = _manifest(prep)
    del manifest["folds"], manifest["fold_seed"]
    for case in manifest["cases"]:
        del case["fold"]
    (prep / "manifest.json").write_text(json.dumps(manifest))
    store = Store.open(prep)
    assert store.folds == 0 and set(_folds_of(store).values()) == {None}
    with pytest.raises(CtsegError, match="has no cross-validation folds; .*ctseg folds"):
        store.for_fold(0)


def test_label_free_cases_are_never_in_a_fold(raw, tmp_path):
    prep = tmp_path / "prep"
    prepare_store(raw, prep, tiny_config())
    manifest = _manifest(prep)
    test_case = manifest["cases"][1]
    test_case.update(split="test", label_source=None, label_counts=None)
    (prep / "manifest.json").write_text(json.dumps(manifest))
    store = write_folds(prep, 2).store
    assert store.case(test_case["id"]).fold is None
    assert sorted(c.fold for c in store.cases if c.labelled) == [0, 0, 1, 1]
    view = store.for_fold(1)
    assert [c.id for c in view.split("test")] == [test_case["id"]]

    manifest = _manifest(prep)
    manifest["cases"][1]["fold"] = 0
    (prep / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CtsegError, match=r"cases\[1\].fold = 0 should be null"):
        Store.open(prep)
    manifest["cases"][1]["fold"] = None
    manifest["cases"][0]["fold"] = 2
    (prep / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CtsegError, match=r"cases\[0\].fold = 2 should be one of 0–1"):
        Store.open(prep)


def test_a_predict_only_store_has_no_folds(tmp_path):
    raw = tmp_path / "raw"
    write_dataset(raw, cases=2, size=24, seed=0)
    for label in raw.glob("segmentation-*"):
        label.unlink()
    with pytest.raises(CtsegError, match="holds no labels"):
        prepare_store(raw, tmp_path / "prep", tiny_config("data.folds=2"))
    prepare_store(raw, tmp_path / "prep", tiny_config())
    with pytest.raises(CtsegError, match="`folds` 2 needs at least 2 labelled cases; .* has 0"):
        write_folds(tmp_path / "prep", 2)


def test_fold_view_validates_on_the_fold_and_trains_on_the_others(raw, tmp_path):
    store = prepare_store(raw, tmp_path / "prep", tiny_config("data.folds=3")).store
    for fold in range(3):
        view = store.for_fold(fold)
        assert {c.id for c in view.split("val")} == {c.id for c in store.fold_cases(fold)}
        assert {c.id for c in view.split("train")} == {c.id for c in store.cases if c.fold != fold}
    with pytest.raises(CtsegError, match="fold 3 is not a fold .* it has 3 folds, 0–2"):
        store.for_fold(3)


# ---------------------------------------------------------------- training one fold


@pytest.fixture(scope="module")
def fold_store(tmp_path_factory):
    """A 16³ store of 4 labelled cases in 3 folds (sizes 2, 1, 1)."""
    root = tmp_path_factory.mktemp("folds")
    write_dataset(root / "raw", cases=4, size=32, seed=5)
    store = prepare_store(root / "raw", root / "prep", tiny_config("data.folds=3")).store
    assert sorted(len(store.fold_cases(f)) for f in range(3)) == [1, 1, 2]
    return root / "prep"


@pytest.fixture(scope="module")
def fold_runs(fold_store, tmp_path_factory):
    """One 2-step run per fold of `fold_store`, and what each saw of the store."""
    root = tmp_path_factory.mktemp("fold-runs")
    seen = {}
    with pytest.MonkeyPatch.context() as patch:
        cases_for_step, validation_batches = (
            pipeline.cases_for_step,
            validation.validation_batches,
        )

        def training_pool(ids, *args):
            seen["train"].update(ids)
            return cases_for_step(ids, *args)

        def validated(store, config, mesh):
            for ids, image, labels in validation_batches(store, config, mesh):
                seen["val"].extend(ids)
                yield ids, image, labels

        patch.setattr(pipeline, "cases_for_step", training_pool)
        patch.setattr(validation, "validation_batches", validated)
        runs = []
        for fold in range(3):
            seen["train"], seen["val"] = set(), []
            seen[fold] = (seen["train"], seen["val"])
            summary = train_and_evaluate(
                tiny_config(*RUN, f"train.fold={fold}"), fold_store, root / f"fold{fold}"
            )
            assert summary.fold == fold
            runs.append(root / f"fold{fold}")
    return runs, {fold: seen[fold] for fold in range(3)}


def test_a_fold_run_trains_on_the_other_folds_and_validates_on_its_fold(fold_store, fold_runs):
    runs, seen = fold_runs
    store = Store.open(fold_store)
    for fold, run_dir in enumerate(runs):
        fold_ids = [c.id for c in store.fold_cases(fold)]
        others = {c.id for c in store.cases if c.fold != fold}
        trained_on, validated_on = seen[fold]
        assert trained_on == others  # the batches were drawn from the other folds only
        assert sorted(validated_on) == sorted(fold_ids)  # each validation: the fold, once
        record = json.loads((run_dir / "fold.json").read_text())
        assert record["fold"] == fold and record["folds"] == 3
        assert record["store"] == str(fold_store.resolve())
        assert record["val_cases"] == fold_ids and set(record["train_cases"]) == others
        assert "fold = " + str(fold) in (run_dir / "config.toml").read_text()


def test_resuming_a_fold_run_with_another_fold_or_other_folds_is_refused(
    fold_store, fold_runs, tmp_path
):
    run_dir = tmp_path / "run"
    shutil.copytree(fold_runs[0][1], run_dir)
    with pytest.raises(CtsegError, match=r"different config \(train.fold\)"):
        train_and_evaluate(tiny_config(*RUN, "train.fold=0"), fold_store, run_dir)
    store = tmp_path / "prep"
    shutil.copytree(fold_store, store)
    write_folds(store, 3, seed=11, force=True)
    assert _folds_of(Store.open(store)) != _folds_of(Store.open(fold_store))
    with pytest.raises(CtsegError, match="trained on fold 1 as it was then .* re-assigned"):
        train_and_evaluate(tiny_config(*RUN, "train.fold=1"), store, run_dir)


def test_a_fold_the_store_does_not_have_is_one_error_line(fold_store, raw, tmp_path):
    for fold, message in [
        (3, "train.fold = 3: fold 3 is not a fold of the store at .*: it has 3 folds, 0–2"),
    ]:
        with pytest.raises(CtsegError, match=message):
            train_and_evaluate(tiny_config(*RUN, f"train.fold={fold}"), fold_store, tmp_path / "r")
    plain = prepare_store(raw, tmp_path / "plain", tiny_config()).store.path
    result = runner.invoke(
        app,
        ["train", "--data", str(plain), "--workdir", str(tmp_path / "r"), "--fold", "0"]
        + [f"--set={o}" for o in ("data.resolution=16", "model.base_filters=2", "model.depth=2")],
    )
    assert isinstance(result.exception, CtsegError)
    assert str(result.exception).startswith("train.fold = 0: the store at")
    assert "has no cross-validation folds" in str(result.exception)
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- cross-validation


def test_cross_validation_predicts_every_case_with_the_run_that_did_not_train_on_it(
    fold_store, fold_runs, tmp_path
):
    runs, _ = fold_runs
    store = Store.open(fold_store)
    out = tmp_path / "cv"
    args = ["evaluate", *map(str, reversed(runs)), "--data", str(fold_store), "--out", str(out)]
    result = runner.invoke(app, [*args, "--cross-validation"])
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    for fold, run_dir in enumerate(runs):
        assert f"fold {fold}: {run_dir}, checkpoint step 2" in output
    assert "Summary over 4 case(s)" in output

    report = json.loads((out / "summary.json").read_text())
    assert report["errors"] == []
    assert [(r["fold"], r["run_dir"], r["checkpoint_step"]) for r in report["runs"]] == [
        (fold, str(run_dir), 2) for fold, run_dir in enumerate(runs)
    ]
    labelled = sorted(c.id for c in store.cases if c.labelled)
    assert sorted(c["case"] for c in report["cases"]) == labelled  # every case, once
    for entry in report["runs"]:
        fold_record = json.loads((Path(entry["run_dir"]) / "fold.json").read_text())
        assert entry["cases"] == [c.id for c in store.fold_cases(entry["fold"])]
        assert not set(entry["cases"]) & set(fold_record["train_cases"])  # never seen in training
    assert sorted(p.name for p in (out / "predictions").iterdir()) == [
        f"{case}_seg.nii.gz" for case in labelled
    ]
    assert len((out / "metrics.csv").read_text().splitlines()) == 1 + len(labelled)
    evaluated = json.loads((out / evaluations.EVALUATED).read_text())
    assert [r["fold"] for r in evaluated["cross_validation"]] == [0, 1, 2]

    # The same as each run's own evaluation of its "val" split (its fold), merged.
    merged = []
    for fold, run_dir in enumerate(runs):
        single = evaluate_run(run_dir, fold_store, "val", tmp_path / f"eval{fold}")
        assert single.run.fold == fold
        assert [c.case for c in single.cases] == report["runs"][fold]["cases"]
        assert single.summary.to_json() == report["runs"][fold]["summary"]
        merged += [c.to_json() for c in single.cases]
    assert report["cases"] == merged

    # One evaluation per folder: the same again is fine, a single run's is refused.
    again = evaluate_cross_validation(runs, fold_store, out)
    assert [c.to_json() for c in again.cases] == report["cases"]
    assert again.to_json() == json.loads((out / "summary.json").read_text())  # what it wrote
    with pytest.raises(CtsegError, match="holds the cross-validation of 3 fold runs"):
        evaluate_run(runs[0], fold_store, "val", out)


def test_cross_validation_refuses_missing_repeated_or_foreign_folds(
    fold_store, fold_runs, raw, tmp_path
):
    runs, _ = fold_runs
    out = tmp_path / "cv"
    twin = tmp_path / "twin0"  # a second run of fold 0
    shutil.copytree(runs[0], twin)
    base = ["evaluate", "--data", str(fold_store), "--out", str(out), "--cross-validation"]
    for given, message in [
        (runs[:2], "needs one run per fold of the store at .* \\(3 folds\\): no run for fold 2$"),
        ([runs[0], twin, runs[2]], "fold 0 has 2 runs \\(.*fold0, .*twin0\\); no run for fold 1$"),
        ([runs[0], runs[0], runs[2]], "fold0 is named twice: name each run once$"),
    ]:
        result = runner.invoke(app, [*base, *map(str, given)])
        assert isinstance(result.exception, CtsegError), result.output
        assert len(str(result.exception).splitlines()) == 1
        assert re.search(message, str(result.exception)), str(result.exception)
    assert not out.exists()

    several = runner.invoke(app, ["evaluate", *map(str, runs), "--data", str(fold_store)])
    assert "an ensemble of several runs writes" in str(several.exception)  # needs --out
    no_out = runner.invoke(app, [*base[:3], "--cross-validation", *map(str, runs)])
    assert "give one" in str(no_out.exception)

    reassigned = tmp_path / "prep"
    shutil.copytree(fold_store, reassigned)
    write_folds(reassigned, 3, seed=11, force=True)
    with pytest.raises(
        CtsegError, match=r"fold\d trained on fold \d as it was then .* re-assigned"
    ):
        evaluate_cross_validation(runs, reassigned, out)
    plain = prepare_store(raw, tmp_path / "plain", tiny_config()).store.path
    with pytest.raises(CtsegError, match="has no cross-validation folds"):
        evaluate_cross_validation(runs, plain, out)
    # A fold run's "val" split is its fold; on a store of other folds it cannot be told apart.
    moved = next(
        r for r in runs if rundir.fold_difference(rundir.read_fold(r), Store.open(reassigned))
    )
    with pytest.raises(CtsegError, match="re-assigned since; its 'val' split cannot be told apart"):
        evaluate_run(moved, reassigned, "val", tmp_path / "eval")


@pytest.mark.parametrize("seed", ["-1", str(2**31), str(2**70)])
def test_a_seed_numpy_cannot_take_is_one_line_before_the_store_is_read(tmp_path, seed):
    result = runner.invoke(app, ["folds", str(tmp_path / "no-store"), "--k", "2", "--seed", seed])
    assert isinstance(result.exception, CtsegError), result.output
    assert str(result.exception).startswith("--seed must")
