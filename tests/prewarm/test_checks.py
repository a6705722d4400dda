"""Preflight checks against fake /proc, /dev, cgroup trees and a fake nvidia-smi binary."""

from __future__ import annotations

import io
import os
import stat
import threading
from pathlib import Path

import pytest
from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.prewarm.checks import (
    CheckResult,
    Host,
    NvidiaSmiProbe,
    Preflight,
    Status,
    check_cpu_features,
    check_draft_model,
    check_memory,
    check_shm_space,
    check_source_files,
    check_target_writable,
    run_checks,
)
from ember_runtime.prewarm.copy import CopyOptions
from ember_runtime.prewarm.errors import PrewarmError
from ember_runtime.prewarm.report import render_table, to_json
from ember_runtime.prewarm.run import prewarm

from tests.prewarm.conftest import MakeSetup, Setup
from tests.support.vocab_gguf import write_vocab_gguf

MODEL = 1 << 20


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _meminfo(kb: int) -> str:
    return f"MemTotal:       99999999 kB\nMemFree:  1 kB\nMemAvailable:   {kb} kB\n"


def _by_name(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {r.name: r for r in results}


def _gpu_results(config: RuntimeConfig, tmp_path: Path, exe: Path) -> dict[str, CheckResult]:
    return _by_name(run_checks(Preflight(config, _host(tmp_path, gpu=NvidiaSmiProbe(str(exe))))))


@pytest.fixture
def setup(make_setup: MakeSetup) -> Setup:
    return make_setup({"model.gguf": os.urandom(MODEL)})


def _host(tmp_path: Path, **kw: object) -> Host:
    proc = _tree(
        tmp_path / "proc", {"meminfo": _meminfo(8 << 20), "cpuinfo": "flags\t: sse avx2\n"}
    )
    fields: dict[str, object] = {
        "proc": proc,
        "dev": tmp_path / "dev",
        "cgroup": tmp_path / "cgroup",
        "env": {},
        "machine": "x86_64",
    }
    fields.update(kw)
    return Host(**fields)  # type: ignore[arg-type]


def test_memory_from_meminfo_and_cgroups(tmp_path: Path, setup: Setup) -> None:
    host = _host(tmp_path, proc=_tree(tmp_path / "p", {"meminfo": _meminfo(4 << 20)}))
    ok = check_memory(Preflight(setup.config, host))
    assert ok.status is Status.OK and ok.value.startswith("available 4295.0 MB (node)")

    _tree(tmp_path / "cgroup", {"memory.max": str(MODEL + (MODEL // 4)), "memory.current": "0"})
    warn = check_memory(Preflight(setup.config, host))
    assert warn.status is Status.WARN and "(cgroup)" in warn.value

    _tree(tmp_path / "cgroup", {"memory.max": "1000", "memory.current": "10"})
    assert check_memory(Preflight(setup.config, host)).status is Status.FAIL


def test_memory_cgroup_v1_and_unlimited(tmp_path: Path, setup: Setup) -> None:
    _tree(
        tmp_path / "cgroup",
        {
            "memory/memory.limit_in_bytes": str(MODEL // 2),
            "memory/memory.usage_in_bytes": "0",
            "memory.max": "max",
        },
    )
    result = check_memory(Preflight(setup.config, _host(tmp_path)))
    assert result.status is Status.FAIL
    assert result.value == "available 0.5 MB (cgroup), model 1.0 MB"


@pytest.mark.parametrize(
    "case",
    [
        ("x86_64", "flags\t: fpu sse avx avx2 fma\n", "cpu", Status.OK),
        ("x86_64", "flags\t: fpu sse avx\n", "cpu", Status.FAIL),
        ("x86_64", "flags\t: fpu sse avx\n", "nvidia-gpu", Status.WARN),
        ("aarch64", "Features\t: fp asimd evtstrm aes\n", "cpu", Status.OK),
        ("aarch64", "Features\t: fp evtstrm\n", "cpu", Status.FAIL),
        ("riscv64", "isa\t: rv64imafdc\n", "cpu", Status.WARN),
    ],
)
def test_cpu_features(
    tmp_path: Path, make_setup: MakeSetup, case: tuple[str, str, str, Status]
) -> None:
    machine, cpuinfo, accelerator, status = case
    s = make_setup({"m": b"m"}, accelerator=accelerator)
    host = _host(tmp_path, machine=machine, proc=_tree(tmp_path / "p", {"cpuinfo": cpuinfo}))
    assert check_cpu_features(Preflight(s.config, host)).status is status


def test_cpu_features_of_this_machine(setup: Setup) -> None:
    result = check_cpu_features(Preflight(setup.config))
    assert result.status is Status.OK, result  # the llama.cpp wheel here runs on this CPU


def test_shm_space_limit_and_reclaim(setup: Setup) -> None:
    pf = Preflight(setup.config, shm_limit_bytes=MODEL + 1000, margin_bytes=0)
    assert check_shm_space(pf).status is Status.OK
    setup.target.mkdir(parents=True)
    (setup.target / "other-model.gguf").write_bytes(b"o" * 2000)  # someone else's bytes count
    assert check_shm_space(pf).status is Status.FAIL
    (setup.target / "other-model.gguf").unlink()
    (setup.target / "model.gguf").write_bytes(b"old" * 1000)  # ours: replaced, so reclaimable
    assert check_shm_space(pf).status is Status.OK


def test_shm_space_from_statvfs(setup: Setup) -> None:
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    assert check_shm_space(Preflight(setup.config, margin_bytes=0)).status is Status.OK
    too_big = Preflight(setup.config, margin_bytes=free + 1)
    result = check_shm_space(too_big)
    assert result.status is Status.FAIL and "(statvfs)" in result.value


def test_target_not_writable(make_setup: MakeSetup, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    s = make_setup({"m": b"m"}, prewarm_dir=str(blocker / "target"))  # ENOTDIR, even for root
    result = check_target_writable(Preflight(s.config))
    assert result.status is Status.FAIL and "Not a directory" in result.value


def test_source_size_mismatch_and_no_files(make_setup: MakeSetup) -> None:
    s = make_setup({"m.gguf": b"1234"})
    (s.model_dir / "m.gguf").write_bytes(b"123")
    assert check_source_files(Preflight(s.config)).value == "size mismatch: m.gguf expected 4 got 3"
    empty = s.config.model_copy(update={"files": []})
    assert check_source_files(Preflight(empty)).status is Status.FAIL


def _fake_nvidia_smi(bin_dir: Path, query: str, banner: str, rc: int = 0) -> Path:
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "nvidia-smi"
    (bin_dir / "query.txt").write_text(query)
    (bin_dir / "banner.txt").write_text(banner)
    exe.write_text(
        "#!/bin/sh\n"
        f'case "$1" in --query-gpu=*) cat "{bin_dir}/query.txt";;\n'
        f'  *) cat "{bin_dir}/banner.txt";; esac\n'
        f"exit {rc}\n"
    )
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


BANNER = "| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4     |\n"


def test_gpu_checks_via_nvidia_smi(tmp_path: Path, make_setup: MakeSetup) -> None:
    s = make_setup({"m": b"m" * MODEL}, accelerator="nvidia-gpu")
    exe = _fake_nvidia_smi(
        tmp_path / "bin",
        "0, NVIDIA H200, 550.54.15, 140000, 143771\n1, NVIDIA H200, 550.54.15, 10, 143771\n",
        BANNER,
    )
    results = _gpu_results(s.config, tmp_path, exe)
    assert results["nvidia driver"].status is Status.OK
    assert results["nvidia driver"].value == "2× NVIDIA H200, driver 550.54.15, CUDA 12.4"
    assert results["gpu memory"].value == "GPU 0: free 146800.6 MB of 150754.8 MB"

    full = _fake_nvidia_smi(tmp_path / "bin", "0, NVIDIA T4, 535.1, 0, 15360\n", BANNER)
    results = _gpu_results(s.config, tmp_path, full)
    assert results["gpu memory"].status is Status.FAIL


def test_gpu_missing_or_broken_driver(tmp_path: Path, make_setup: MakeSetup) -> None:
    s = make_setup({"m": b"m"}, accelerator="nvidia-gpu")
    result = _gpu_results(s.config, tmp_path, tmp_path / "no-such-nvidia-smi")["nvidia driver"]
    assert result.status is Status.FAIL and "not found" in result.value

    broken = _fake_nvidia_smi(tmp_path / "bin", "NVIDIA-SMI has failed\n", "", rc=9)
    result = _gpu_results(s.config, tmp_path, broken)["nvidia driver"]
    assert result.status is Status.FAIL
    assert result.value == "nvidia-smi exit 9: NVIDIA-SMI has failed"


def test_npu_device_nodes_and_env(tmp_path: Path, make_setup: MakeSetup) -> None:
    s = make_setup({"m": b"m"}, accelerator="npu")
    dev = _tree(tmp_path / "dev", {"davinci0": "", "davinci_manager": "", "devmm_svm": ""})
    host = _host(tmp_path, dev=dev, env={"ASCEND_DEVICE_ID": "0"})
    results = _by_name(run_checks(Preflight(s.config, host)))
    assert results["npu devices"].value == "missing hisi_hdc"
    assert results["npu env"].status is Status.OK

    (dev / "hisi_hdc").write_text("")
    results = _by_name(run_checks(Preflight(s.config, _host(tmp_path, dev=dev, env={}))))
    assert results["npu devices"].status is Status.OK
    assert results["npu devices"].value == "davinci0"
    assert results["npu env"].value == "neither ASCEND_DEVICE_ID nor ACL_CONTEXT_ID is set"


def test_report_table_and_json() -> None:
    results = [
        CheckResult("source files", Status.OK, "1 files"),
        CheckResult("free memory", Status.WARN, "available 1.0 MB", "tight"),
        CheckResult("gpu memory", Status.FAIL, "free 0.0 MB"),
    ]
    table = render_table(results).splitlines()
    assert table[1].startswith("✅ source files")
    assert table[2].startswith("⚠️  free memory") and table[2].endswith("tight")
    assert table[3].startswith("❌ gpu memory")
    assert table[-1] == "FAIL: 1 ok, 1 warnings, 1 failed"
    doc = to_json(results)
    assert doc["ok"] is False and doc["summary"] == {"ok": 1, "warn": 1, "fail": 1}
    assert doc["checks"][1] == {
        "name": "free memory",
        "status": "warn",
        "value": "available 1.0 MB",
        "detail": "tight",
    }


DRAFT = {"speculation": {"draftModel": "draft.gguf"}}


def test_a_draft_model_of_the_same_vocabulary_passes(
    make_setup: MakeSetup, gemma_path: Path
) -> None:
    same = make_setup({"m.gguf": gemma_path, "draft.gguf": gemma_path}, engine=DRAFT)
    ok = check_draft_model(Preflight(same.config))
    assert ok.status is Status.OK and "the same vocabulary" in ok.value


def test_a_draft_model_of_another_vocabulary_fails_before_anything_is_copied(
    make_setup: MakeSetup, gemma_path: Path, tmp_path: Path
) -> None:
    """Refused with its reason: the pod's termination message, then the object's Degraded
    reason (tests/operator/test_reasons_node.py)."""
    other = write_vocab_gguf(tmp_path / "other.gguf").read_bytes()
    bad = make_setup({"m.gguf": gemma_path, "draft.gguf": other}, engine=DRAFT)
    with pytest.raises(PrewarmError) as err:
        prewarm(Preflight(bad.config), CopyOptions(), io.StringIO(), threading.Event())
    assert err.value.reason == "DraftVocabularyMismatch"
    assert err.value.termination_message().startswith(
        "DraftVocabularyMismatch: draft model: draft.gguf has another vocabulary than m.gguf: "
        "vocabulary size 10 against 262144"
    ), err.value.termination_message()
    assert not bad.target.exists() or not any(bad.target.iterdir()), "copied before the check"


def test_a_draft_model_must_be_another_file_of_the_model(make_setup: MakeSetup) -> None:
    s = make_setup({"m.gguf": b"m", "d.gguf": b"d"})
    for draft, ok in (("d.gguf", True), ("m.gguf", False), ("x.gguf", False)):
        fields = s.config.model_dump(by_alias=True)
        fields["engine"]["speculation"]["draftModel"] = draft
        if ok:
            assert RuntimeConfig.model_validate(fields).draft_file() is not None
        else:
            with pytest.raises(ValueError, match="must name a file of files other than the first"):
                RuntimeConfig.model_validate(fields)
