"""Live curves: train_log.tsv grows as a run trains and TensorBoard event files hold its scalars
(read back with TensorBoard's own loader); a resumed run shows no step twice; the metrics are
the same bytes with the event files on or off."""
import signal
import subprocess

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipeline_src.train import preemption
from pipeline_src.study.stages import output_path
from test_preemption import _start_and_wait_for_the_loop, signal_dir  # noqa: F401  (fixture)
from test_train import _clear, _env, _outputs, _train_cmd

WC = dict(study="tiny", task="reorder", cell="baseline", seed=0)


def _scalars(run_dir) -> dict:
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _rows(tsv) -> list[list[str]]:
    return [line.split("\t") for line in tsv.read_text().splitlines()[1:]]


def test_the_log_grows_while_training_and_a_resumed_run_logs_no_step_twice(signal_dir):  # noqa: F811
    d = signal_dir
    metrics, _, _ = _outputs(d)
    tsv = d / output_path("train", "log", **WC)
    _clear(d)
    proc = _start_and_wait_for_the_loop(d, _env(PIPELINE_QUIET="0"))
    while not tsv.exists() or len(_rows(tsv)) < 3:  # rows arrive while the loop runs
        assert proc.poll() is None, "the run ended before its log had three rows"
    proc.send_signal(signal.SIGTERM)
    proc.stderr.read()
    assert proc.wait() == preemption.EXIT_SAVED and not metrics.exists()
    stopped_rows = _rows(tsv)
    assert [int(r[0]) for r in stopped_rows][:3] == [1, 10, 20]  # log_every 10, and step 1

    subprocess.run(_train_cmd("signal.yaml"), cwd=d, env=_env(), check=True, capture_output=True)
    steps = [int(r[0]) for r in _rows(tsv)]
    assert steps == sorted(set(steps)) and steps[-1] == 400  # every logged step once, in order
    assert _rows(tsv)[:len(stopped_rows)] == stopped_rows  # the rows written live were the final ones
    scalars = _scalars(tsv.parent)
    assert {"loss/train", "loss/validation", "lr", "grad_norm", "tokens_per_s"} <= set(scalars)
    assert [s for s, _ in scalars["loss/train"]] == steps  # TensorBoard dropped nothing and shows no step twice
    assert [s for s, _ in scalars["loss/validation"]] == [400]  # eval_every 400
    train_loss = {int(r[0]): float(r[2]) for r in _rows(tsv)}
    assert all(abs(v - train_loss[s]) < 1e-4 * max(1.0, abs(v)) for s, v in scalars["loss/train"])


def test_metrics_are_the_same_bytes_with_and_without_event_files(signal_dir):  # noqa: F811
    d = signal_dir
    metrics, _, _ = _outputs(d)
    run_dir = (d / output_path("train", "log", **WC)).parent
    results = []
    for tensorboard in ("1", "0"):
        _clear(d)
        subprocess.run(["rm", "-rf", str(run_dir / "tensorboard")], check=True)
        subprocess.run(_train_cmd("signal.yaml"), cwd=d, env=_env(PIPELINE_TENSORBOARD=tensorboard), check=True,
                       capture_output=True)
        results.append(metrics.read_bytes())
        assert (run_dir / "tensorboard").exists() == (tensorboard == "1")
    assert results[0] == results[1]
