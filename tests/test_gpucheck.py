"""`agentrl doctor --gpu` on a machine without CUDA (CI): it skips itself in one line; its
section runner and report behave (a failing section is reported, the others still run)."""

import json

from agentrl.gpucheck import _section_runner, markdown


def test_without_cuda_the_gpu_check_skips_itself_in_one_line(tmp_path):
    import torch

    from tests.test_cli import agentrl

    if torch.cuda.is_available():  # a GPU machine runs the real check instead
        return
    proc = agentrl("doctor", "--gpu", "--out", str(tmp_path / "gc"), env={"COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [
        "no CUDA device here: the GPU check skips itself (run `agentrl doctor --gpu` on a GPU machine)"]
    assert not (tmp_path / "gc").exists()


def test_a_failing_section_is_reported_and_the_others_still_run():
    report = {"date": "2026-11-23 10:00", "device": "CPU (x86_64)", "quick": True, "torch": "2.13.0", "sections": {}}
    lines: list[str] = []
    section = _section_runner(report, lines.append)
    section("throughput", lambda: {"tokens_per_s_by_batch": {"1": 12.5}})
    section("rollout", lambda: 1 / 0)
    section("learner", lambda: {"train_s": 0.5})
    report["sections"]["vllm"] = {"ok": None, "skipped": "vLLM does not import here"}
    s = report["sections"]
    assert s["throughput"]["ok"] and s["throughput"]["tokens_per_s_by_batch"] == {"1": 12.5}
    assert s["rollout"]["ok"] is False and s["rollout"]["error"] == "ZeroDivisionError: division by zero"
    assert "1 / 0" in s["rollout"]["trace"] and s["learner"]["ok"]
    assert "gpu check: rollout: FAILED" in lines[3]
    md = markdown(report)
    assert "| rollout | **failed** after" in md and "| vllm | skipped: vLLM does not import here |" in md
    assert '| throughput | wall_s ' in md and 'tokens_per_s_by_batch {"1": 12.5}' in md and "trace" not in md
    json.dumps(report)  # what gpu_check.json holds


def test_the_training_shaped_lockstep_section_runs(tiny_model, tokenizer):
    """The section `doctor --gpu` measures an H100 with (128 rows x ~2k tokens, 30 new), at tiny size here."""
    from agentrl.gpucheck import _lockstep
    from agentrl.sampling.hf import HFSampler

    sampler = HFSampler(tiny_model, tokenizer)
    r = _lockstep(sampler, tokenizer, {"shape": (3, 64, 4, 2)})
    assert r["rows"] == 3 and r["s_per_step"] > 0 and r["tokens_per_s"] > 0 and r["kv_store_gb"] >= 0
    assert r["ms_per_token"] > 0 and r["kv_read_gb"] > 0 and r["weights_gb"] > 0
    assert r["bandwidth_tb_s"] is None and r["floor_ms_per_token"] is None  # a CPU: no bandwidth in the table
    assert sampler.store.live == 0 and sampler.stop_ids  # its rows released, the stop tokens restored


def test_the_lockstep_section_measures_the_static_step_and_the_eager_loop(tiny_model, tokenizer):
    from agentrl.gpucheck import _lockstep_graphs_on_off
    from agentrl.sampling.hf import HFSampler

    sampler = HFSampler(tiny_model, tokenizer, static_decode="on")
    static = sampler.static
    r = _lockstep_graphs_on_off(sampler, tokenizer, {"shape": (3, 64, 4, 2)})
    assert set(r["by_decode"]) == {"graphs", "eager"} and r["ms_per_token"] == r["by_decode"]["graphs"]["ms_per_token"]
    assert static.replays > 0 and sampler.static is static  # the decoder it was built with is back
