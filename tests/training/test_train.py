"""The training loop: layout-independent batches, exact resume, guards, run directory."""

import contextlib
import gc
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import TINY, prepare_store, tiny_config

from ctseg import config as cfg
from ctseg.data.store import Store
from ctseg.errors import CtsegError
from ctseg.model.step import abstract_state
from ctseg.parallel import devices as dev
from ctseg.parallel.partition import make_mesh, replicated_shapes
from ctseg.run import checkpoints
from ctseg.run.rundir import MetricsLog
from ctseg.run.trained import load_model
from ctseg.synth.dataset import write_dataset
from ctseg.training import loop, pipeline
from ctseg.training.loop import train_and_evaluate
from ctseg.training.validation import population_statistics

TRAIN = [
    *TINY,
    "model.depth=3",
    "mesh.spatial=[2,2,1]",
    "train.steps=4",
    "train.eval_every=2",
    "train.checkpoint_every=2",
    "train.log_every=1",
    "train.warmup_steps=1",
    "train.rotate90=true",
    # Weights averaged for inference, so that resuming and layouts are tested with them.
    "train.ema_decay=0.5",
    # nnU-Net's transforms on the devices, so that resuming and layouts are tested with them.
    "augment.rotation_p=0.5",
    "augment.scaling_p=0.5",
    "augment.noise_p=0.5",
    "augment.gamma_p=0.5",
    "augment.phase_p=0.5",
]


def tiny(*extra: str) -> cfg.Config:
    return tiny_config(*TRAIN, *extra)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    write_dataset(root / "raw", cases=4, size=32, seed=3)
    prepare_store(root / "raw", root / "prep", tiny())
    return root / "prep"


@pytest.fixture(scope="module")
def uninterrupted(store_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run") / "full"
    train_and_evaluate(tiny(), store_dir, run_dir)
    return run_dir


def final_params(run_dir):
    """Parameters and batch-norm statistics of the run's last checkpoint, as leaves."""
    config = cfg.load(run_dir / "config.toml")
    model = load_model(run_dir, "latest")
    params, stats, step = model.params, model.stats, model.step
    assert step == config.train.steps
    return jax.tree.leaves(jax.device_get((params, stats)))  # batch-norm statistics too


def test_global_batch_is_the_same_on_every_layout(store_dir):
    config = tiny("train.batch_size=2", "mesh.data=2")
    store = Store.open(store_dir)
    batches = [
        jax.device_get(pipeline.training_batch(store, config, make_mesh(spatial, data), step=5))
        for spatial, data in (((1, 1, 1), 1), ((2, 2, 1), 2), ((1, 2, 4), 2))
    ]
    for other in batches[1:]:
        for got, want in zip(other, batches[0], strict=True):
            np.testing.assert_array_equal(got, want)
    assert not np.array_equal(batches[0][1][0], batches[0][1][1])  # two different cases


def population_statistics_on(config, store):
    """The pooled batch-norm statistics of a fresh model on `config`'s mesh, on the host."""
    from jax.sharding import NamedSharding

    from ctseg.model import step
    from ctseg.parallel.partition import REPLICATED

    mesh = make_mesh(config.mesh.spatial, config.mesh.data)
    graphdef, state = step.init_state(config)
    state = jax.device_put(state, NamedSharding(mesh, REPLICATED))
    batch_statistics = jax.jit(step.make_batch_statistics(graphdef, config, mesh))
    pool = jax.jit(step.pool_statistics)
    updated = population_statistics(batch_statistics, pool, state, store, config, mesh)
    return state.params, jax.device_get(updated.stats)


def test_population_statistics_are_the_same_on_every_layout(store_dir):
    """1 and 16 partitions and data parallelism: one set of statistics,
    and its first layer's is the moments of the first convolution over every volume."""
    store = Store.open(store_dir)
    layouts = (
        ["mesh.spatial=[1,1,1]"],
        ["mesh.spatial=[4,4,1]"],
        ["mesh.spatial=[1,2,4]", "mesh.data=2"],
    )
    runs = [
        population_statistics_on(
            tiny("train.batch_size=2", "train.bn_population_volumes=3", *o), store
        )
        for o in layouts
    ]
    params, want = runs[0]
    for _, got in runs[1:]:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    # Independent reference for the first layer: 3 volumes cycled into 2 batches of 2.
    config = tiny("train.batch_size=2", "train.bn_population_volumes=3")
    images = np.concatenate(
        list(jax.device_get(list(pipeline.statistics_batches(store, config, make_mesh((1, 1, 1))))))
    )
    assert images.shape[0] == 4
    kernel = np.asarray(params["down"][0]["first"]["conv"]["kernel"][...])
    conv = jax.lax.conv_general_dilated(
        images, kernel, (1, 1, 1), "SAME", dimension_numbers=("NDHWC", "DHWIO", "NDHWC")
    )
    conv = np.asarray(conv, np.float64).reshape(-1, kernel.shape[-1])
    first = want["down"][0]["first"]["norm"]
    np.testing.assert_allclose(first["mean"][...], conv.mean(axis=0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(first["var"][...], conv.var(axis=0), rtol=1e-4, atol=1e-6)


def test_run_directory_holds_config_metrics_curves_and_best_checkpoint(uninterrupted):
    assert cfg.load(uninterrupted / "config.toml") == tiny()
    entries = [line for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    assert len(entries) == 4 and '"val_dice_liver"' in entries[-1]
    assert (uninterrupted / "curves.png").stat().st_size > 0
    manager = checkpoints.Checkpoints(uninterrupted, keep=1, read_only=True)
    assert manager.resolve("best") in (2, 4) and manager.resolve("latest") == 4
    manager.close()


def test_checkpoints_predict_with_the_moving_average_of_the_weights(uninterrupted):
    """`train.ema_decay`: a checkpoint holds the trained weights (to resume) and their
    moving average, and the model loaded for inference is the average."""
    config = cfg.load(uninterrupted / "config.toml")
    manager = checkpoints.Checkpoints(uninterrupted, keep=1, read_only=True)
    _, like = abstract_state(config)
    state = manager.restore(4, replicated_shapes(like, make_mesh((1, 1, 1))))
    manager.close()
    model = load_model(uninterrupted, "4")
    average, trained = jax.tree.leaves(state.average), jax.tree.leaves(state.params)
    for loaded, want, other in zip(jax.tree.leaves(model.params), average, trained, strict=True):
        np.testing.assert_array_equal(loaded, want)
        assert not np.array_equal(loaded, other)


class Crash(Exception):
    """Raised from the progress callback: the run dies after a chosen step."""


def crash_after(step):
    def progress(p):
        if p.step == step:
            raise Crash

    return progress


def test_crash_then_resume_ends_with_identical_parameters(
    store_dir, uninterrupted, tmp_path, monkeypatch
):
    with pytest.raises(Crash):
        train_and_evaluate(tiny(), store_dir, tmp_path, progress=crash_after(3))
    # The resumed run's last validation is its best (validation changes no parameter):
    # the summary must count the final checkpoint, whose save finishes after the loop.
    monkeypatch.setattr(loop, "validation_dice", lambda *args: {"liver": 0.9, "tumour": 0.9})
    resolve = checkpoints.Checkpoints.resolve

    def resolve_once_written(self, which):
        assert self._pending is None, "`best` resolved while the last save was being written"
        return resolve(self, which)

    monkeypatch.setattr(checkpoints.Checkpoints, "resolve", resolve_once_written)
    summary = train_and_evaluate(tiny(), store_dir, tmp_path)
    assert summary.step == 4
    for got, want in zip(final_params(tmp_path), final_params(uninterrupted), strict=True):
        np.testing.assert_array_equal(got, want)
    steps = [
        int(line.split('"step": ')[1].split(",")[0])
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3, 4]  # the lost step 3 was logged once, not twice
    # The summary names the best and the last validation and the checkpoint predict takes.
    entries = MetricsLog.read(tmp_path)
    validated = [e for e in entries if "val_dice_liver" in e]
    best = max(validated, key=lambda e: (e["val_dice_liver"] + e["val_dice_tumour"], e["step"]))
    assert summary.last_validation.step == 4
    assert summary.best_validation.step == best["step"] == summary.predict_checkpoint == 4
    assert summary.best_validation.liver == best["val_dice_liver"]


def test_frozen_norm_steps_train_against_the_statistics_of_their_first_step(
    store_dir, uninterrupted, tmp_path
):
    """`train.frozen_norm_share=0.5` of 4 steps: steps 3 and 4 keep the statistics of step 2
    while the weights move, and a run cut in that phase resumes to the same parameters."""
    config = tiny("train.frozen_norm_share=0.5")
    frozen = []
    train_and_evaluate(config, store_dir, tmp_path / "full", lambda p: frozen.append(p.frozen_norm))
    assert frozen == [False, False, True, True]  # what the progress bar says
    at_frozen = load_model(tmp_path / "full", "2")
    last = load_model(tmp_path / "full", "latest")
    for a, b in zip(jax.tree.leaves(last.stats), jax.tree.leaves(at_frozen.stats), strict=True):
        np.testing.assert_array_equal(a, b)
    moved = [
        not np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(last.params), jax.tree.leaves(at_frozen.params), strict=True
        )
    ]
    assert all(moved)
    # The same steps 1–2 as a run without frozen statistics; steps 3–4 differ from it.
    unfrozen = load_model(uninterrupted, "latest")
    assert not np.array_equal(jax.tree.leaves(last.params)[0], jax.tree.leaves(unfrozen.params)[0])

    with pytest.raises(Crash):
        train_and_evaluate(config, store_dir, tmp_path / "cut", progress=crash_after(3))
    train_and_evaluate(config, store_dir, tmp_path / "cut")
    for got, want in zip(
        final_params(tmp_path / "cut"), final_params(tmp_path / "full"), strict=True
    ):
        np.testing.assert_array_equal(got, want)


def start_train_command(store_dir, run_dir, overrides, **popen):
    """`ctseg train` in a subprocess with this process's device count (XLA:CPU may
    split work differently on another count, which would break bit-identity)."""
    # Ctrl-C as in a terminal, even when these tests run in a background job
    # (`nohup make test &`), whose children inherit SIGINT ignored.
    ctseg = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    ctseg += "from ctseg.cli.main import main; main()"
    command = [sys.executable, "-c", ctseg, "train", "--data", str(store_dir)]
    command += ["--workdir", str(run_dir)]
    for item in overrides:
        command += ["--set", item]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "16"}
    return subprocess.Popen(command, env=env, **popen)


def test_sigkill_at_any_moment_then_resume_is_bit_identical(store_dir, uninterrupted, tmp_path):
    proc = start_train_command(
        store_dir, tmp_path, TRAIN, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 240
    while not (tmp_path / "checkpoints" / "2").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "training subprocess made no checkpoint"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    # Proof that the run was cut short: it died by the signal, before its last checkpoint.
    assert proc.wait() == -signal.SIGKILL
    assert not (tmp_path / "checkpoints" / "4").exists()
    train_and_evaluate(tiny(), store_dir, tmp_path)
    got, want = final_params(tmp_path), final_params(uninterrupted)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("stop", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(stop, status, store_dir, tmp_path):
    overrides = [*TRAIN, "train.steps=200", "train.checkpoint_every=100", "train.eval_every=100"]
    proc = start_train_command(
        store_dir, tmp_path, overrides, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 240
    log = tmp_path / "metrics.jsonl"
    # Interrupt once training is under way (some steps logged), well before any checkpoint.
    while not (log.exists() and log.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)
    proc.send_signal(stop)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == status, output
    assert "interrupted" in output and "Traceback" not in output
    manager = checkpoints.Checkpoints(tmp_path, keep=1, read_only=True)
    assert 3 <= manager.latest_step() < 100  # saved on Ctrl-C, not by the schedule
    manager.close()


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(store_dir, tmp_path):
    config = tiny(
        "train.learning_rate=1e38",
        "train.checkpoint_every=1",
        "train.eval_every=100",
        "train.steps=6",
    )
    with pytest.raises(CtsegError, match=r"loss became nan at step \d") as error:
        train_and_evaluate(config, store_dir, tmp_path)
    assert "data look sound" in str(error.value) and "last good one" in str(error.value)
    manager = checkpoints.Checkpoints(tmp_path, keep=1, read_only=True)
    assert manager.latest_step() is not None and manager.latest_step() < 6
    manager.close()


def test_store_of_another_grid_is_refused_before_compiling(store_dir, tmp_path):
    with pytest.raises(CtsegError, match="holds a store of 16³ cube but .* asks for 32³ cube"):
        train_and_evaluate(tiny("data.resolution=32"), store_dir, tmp_path)


def test_missing_store_is_refused(tmp_path):
    with pytest.raises(CtsegError):
        train_and_evaluate(tiny(), tmp_path / "nowhere", tmp_path / "run")


def test_resuming_with_another_config_is_refused(store_dir, uninterrupted):
    with pytest.raises(CtsegError, match="train.learning_rate"):
        train_and_evaluate(tiny("train.learning_rate=0.5"), store_dir, uninterrupted)


# A full disk, without root: writes past RLIMIT_FSIZE fail with EFBIG ("File too large"),
# through tensorstore as through Python, once SIGXFSZ no longer kills the process.
# 20 kB lets config.toml and metrics.jsonl through but no checkpoint (one holds files of ~60 kB).
FULL_DISK = 20_000


@contextlib.contextmanager
def file_size_limit(limit):
    """Lower this process's soft RLIMIT_FSIZE and ignore SIGXFSZ, until the block ends.

    A child started inside the block inherits both (Popen(restore_signals=False)).
    """
    handler, previous = signal.getsignal(signal.SIGXFSZ), resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, previous[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, handler)


def checkpoint_folders(run_dir):
    return sorted(os.listdir(run_dir / "checkpoints"))


def test_full_disk_while_training_is_one_error_line_and_keeps_the_last_checkpoint(
    store_dir, uninterrupted, tmp_path
):
    # The run as it stood after step 2; resuming it saves step 4 when the disk is full.
    shutil.copytree(uninterrupted, tmp_path, dirs_exist_ok=True)
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    with file_size_limit(FULL_DISK):  # no preexec_fn: it forks a multithreaded process
        proc = start_train_command(
            store_dir,
            tmp_path,
            TRAIN,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            restore_signals=False,
        )
    output, errors = proc.communicate(timeout=240)
    assert proc.returncode == 2, errors
    # Orbax's background threads log the failed writes with tracebacks: none may show.
    assert "Traceback" not in output + errors
    (line,) = errors.strip().splitlines()
    assert line.startswith("error: could not save checkpoint 4 in ") and "File too large" in line
    assert "step 2 is the latest intact one" in line
    # The half-written step 4 is not a checkpoint; step 2 still restores.
    assert [n for n in checkpoint_folders(tmp_path) if "orbax-checkpoint-tmp" not in n] == ["2"]
    assert load_model(tmp_path, "latest").step == 2


def test_failed_background_save_is_reported_at_the_next_save_under_its_own_step(
    uninterrupted, tmp_path
):
    shutil.copytree(uninterrupted, tmp_path, dirs_exist_ok=True)
    _, abstract = abstract_state(tiny())
    manager = checkpoints.Checkpoints(tmp_path, keep=3)
    state = manager.restore(4, replicated_shapes(abstract, make_mesh((1, 1, 1))))
    later = state._replace(step=state.step + 2)
    with file_size_limit(FULL_DISK), pytest.raises(CtsegError) as failure:
        manager.save(later)  # step 6: fails in orbax's background thread...
        manager.save(state._replace(step=state.step + 4))  # ...and is reported here
    manager.close()
    # Orbax leaves the failed save's unfinished writes to the garbage collector, which
    # warns about each: collect them here rather than in whichever test runs next.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        gc.collect()
    message = str(failure.value)
    assert message.startswith("could not save checkpoint 6 in ") and "\n" not in message
    assert "File too large (step 4 is the latest intact one;" in message
    reader = checkpoints.Checkpoints(tmp_path, keep=1, read_only=True)
    assert reader.manager.all_steps() == [2, 4] and reader.resolve("latest") == 4
    reader.close()
    for got, want in zip(final_params(tmp_path), final_params(uninterrupted), strict=True):
        np.testing.assert_array_equal(got, want)
    # Resuming: the leftover temporary folder goes, and step 6 can be saved again.
    manager = checkpoints.Checkpoints(tmp_path, keep=3)
    manager.save(later)
    manager.close()
    assert checkpoint_folders(tmp_path) == ["2", "4", "6"]


def test_metrics_log_on_a_full_disk_is_one_error_line(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    log = MetricsLog(tmp_path, resume_step=0)
    log.path = Path("/dev/full")  # every write: ENOSPC
    with pytest.raises(CtsegError, match="No space left on device"):
        log.append({"step": 1, "loss": 0.5})


def test_resume_on_another_layout_equals_the_run_that_never_moved(
    store_dir, uninterrupted, tmp_path
):
    """2 steps on [4, 4, 1], 2 more on [1, 1, 1]: the 4-step run on [2, 2, 1], to float sums.
    The mesh is not part of the run's identity; layouts.jsonl says which trained what."""

    with pytest.raises(Crash):
        train_and_evaluate(tiny("mesh.spatial=[4,4,1]"), store_dir, tmp_path, crash_after(2))
    said: list[str] = []
    summary = train_and_evaluate(tiny("mesh.spatial=[1,1,1]"), store_dir, tmp_path, say=said.append)
    assert summary.step == 4
    # A resumed run says so before it compiles: from which step, and where it trained before.
    assert said == [
        "resuming from checkpoint 2 (of 4 steps); steps 0–2 trained on mesh.spatial "
        f"[4, 4, 1], data 1: {dev.describe(jax.devices()[:16], simulated=True)}"
    ]
    for got, want in zip(final_params(tmp_path), final_params(uninterrupted), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    history = [json.loads(line) for line in (tmp_path / "layouts.jsonl").read_text().splitlines()]
    assert [(h["from_step"], h["mesh"]["spatial"]) for h in history] == [
        (0, [4, 4, 1]),
        (2, [1, 1, 1]),
    ]
    assert history[0]["devices"] == "16 simulated CPU devices" + history[0]["devices"][24:]
    # The rest of the config still is the run's identity.
    with pytest.raises(CtsegError, match=r"different config \(model.base_filters\)"):
        train_and_evaluate(tiny("model.base_filters=4"), store_dir, tmp_path)


def test_workdir_of_other_files_or_a_file_is_refused(store_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CtsegError, match="already holds files that ctseg did not write"):
        train_and_evaluate(tiny(), store_dir, tmp_path)
    with pytest.raises(CtsegError, match="is a file, not a folder"):
        train_and_evaluate(tiny(), store_dir, tmp_path / "notes.txt")


def test_nan_loss_from_bad_labels_names_the_case(store_dir, tmp_path):
    from ctseg.data.manifest import PREPARE_AGAIN
    from ctseg.training.loop import _nan_cause

    bad = tmp_path / "prep"
    shutil.copytree(store_dir, bad)
    case = Store.open(bad).split("train")[0].id
    label = bad / "cases" / case / "label.npy"
    np.save(label, np.full_like(np.load(label), 7))
    cause = _nan_cause(Store.open(bad))
    assert f"case {case} holds the value 7" in cause
    assert cause.endswith(PREPARE_AGAIN)


def test_cli_warns_when_the_store_has_no_validation_cases(monkeypatch, store_dir, tmp_path):
    from typer.testing import CliRunner

    import ctseg.cli.main  # noqa: F401  (registers the commands)
    import ctseg.training.loop
    from ctseg.cli.app import app

    summary = ctseg.training.loop.TrainingSummary(
        step=4,
        val_dice=None,
        last_validation=None,
        best_validation=None,
        predict_checkpoint=4,
        data_wait_fraction=0.0,
        run_dir=tmp_path,
        val_cases=0,
        train_cases=4,
        fold=None,
    )
    monkeypatch.setattr(ctseg.training.loop, "train_and_evaluate", lambda *a, **k: summary)
    args = ["train", "--data", str(store_dir), "--workdir", str(tmp_path)]
    result = CliRunner().invoke(app, [*args, *[f"--set={o}" for o in TRAIN]])
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "warning: the store has no validation cases" in output
    assert "`ctseg predict` and `ctseg evaluate` use checkpoint 4 (latest;" in output
    assert "validation Dice:" not in output


def test_the_summary_as_json_is_the_dict_train_and_evaluate_returned(tmp_path):
    from ctseg.training.loop import TrainingSummary, Validation

    best, last = Validation(2, 0.75, 0.5), Validation(4, 0.5, 0.25)
    summary = TrainingSummary(
        4, {"liver": 0.5, "tumour": 0.25}, last, best, 2, 0.125, tmp_path, 1, 3, 0
    )
    assert summary.to_json() == {
        "step": 4,
        "val_dice": {"liver": 0.5, "tumour": 0.25},
        "last_validation": {"step": 4, "liver": 0.5, "tumour": 0.25},
        "best_validation": {"step": 2, "liver": 0.75, "tumour": 0.5},
        "predict_checkpoint": 2,
        "data_wait_fraction": 0.125,
        "run_dir": str(tmp_path),
        "val_cases": 1,
        "train_cases": 3,
        "fold": 0,
    }
    json.dumps(summary.to_json())


def test_cli_prints_each_validation_on_a_line_and_keeps_the_bar_within_80_columns(
    monkeypatch, store_dir, tmp_path
):
    from typer.testing import CliRunner

    import ctseg.cli.main  # noqa: F401  (registers the commands)
    import ctseg.training.loop
    from ctseg.cli.app import app
    from ctseg.progress import StepProgress

    def train(config, data, run_dir, progress, *args, **kwargs):
        dice = {"liver": 0.5, "tumour": 0.25}
        for step in (1, 2, 3, 4):
            validated = step in (2, 4)
            frozen = step > 2
            progress(StepProgress(step, 4, 1.2345, 0.5, dice, frozen, validated))
        return ctseg.training.loop.TrainingSummary(
            4, dice, None, None, 4, 0.0, tmp_path, 1, 3, None
        )

    monkeypatch.setattr(ctseg.training.loop, "train_and_evaluate", train)
    args = ["train", "--data", str(store_dir), "--workdir", str(tmp_path)]
    result = CliRunner().invoke(app, [*args, *[f"--set={o}" for o in TRAIN]], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for step in (2, 4):
        assert f"step {step}: validation Dice liver 0.500, tumour 0.250" in lines
    bar = next(line for line in lines if line.startswith("train"))
    assert "4/4 loss 1.2345  0.50 steps/s  frozen batch-norm" in bar and "…" not in bar
