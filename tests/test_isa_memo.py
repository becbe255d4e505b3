"""The memo of inductor's CPU ISA probes (pimm_fn.compile.isa_memo): keyed by machine, answered from disk."""
import json
import os
import subprocess
import sys
import textwrap


def _python(code: str, cache_home, **env) -> str:
    full = {**os.environ, "XDG_CACHE_HOME": str(cache_home), **env}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


PROBE = """
    from pimm_fn.compile import isa_memo
    from torch._inductor import cpu_vec_isa
    {before}
    on = isa_memo.install()
    isa = cpu_vec_isa.VecAVX2()
    print(on, isa.check_build(cpu_vec_isa.VecISA._avx_code))
"""


def test_a_probe_answer_is_kept_and_answers_the_next_process(tmp_path):
    first = _python(PROBE.format(before=""), tmp_path)
    on, answer = first.split()
    assert on == "True" and answer in ("True", "False")
    memo = json.loads((tmp_path / "pimm_fn" / "inductor_isa_probes.json").read_text())
    assert list(memo.values()) == [answer == "True"]
    # The next process gets the answer from the file: torch's own probe is not run at all
    # (here it would raise).
    broken = """
    def _no_probe(self, code):
        raise AssertionError("probed although the memo holds the answer")
    cpu_vec_isa.VecISA.check_build = _no_probe
    """
    assert _python(PROBE.format(before=textwrap.dedent(broken).replace("\n", "\n    ")), tmp_path) == first


def test_the_key_names_the_cpu_and_a_bad_file_is_ignored(tmp_path):
    from torch._inductor import cpu_vec_isa

    from pimm_fn.compile import isa_memo

    isa = cpu_vec_isa.VecAVX2()
    code = cpu_vec_isa.VecISA._avx_code
    assert isa_memo.probe_key(isa, code, "avx2 fma") != isa_memo.probe_key(isa, code, "sse2")
    assert isa_memo.probe_key(isa, code, "avx2 fma") == isa_memo.probe_key(isa, code, "avx2 fma")
    path = tmp_path / "pimm_fn" / "inductor_isa_probes.json"
    path.parent.mkdir(parents=True)
    path.write_text("{ not json")
    on, answer = _python(PROBE.format(before=""), tmp_path).split()
    assert on == "True" and list(json.loads(path.read_text()).values()) == [answer == "True"]


def test_turned_off_by_the_environment(tmp_path):
    code = """
    from pimm_fn.compile import isa_memo
    from torch._inductor import cpu_vec_isa
    before = cpu_vec_isa.VecISA.check_build
    print(isa_memo.install(), cpu_vec_isa.VecISA.check_build is before)
    """
    assert _python(code, tmp_path, PIMM_FN_ISA_MEMO="0") == "False True"
    assert not (tmp_path / "pimm_fn").exists()


def test_compile_step_leaves_torch_alone_unless_opted_in(tmp_path):
    code = """
    import os
    from torch._inductor import cpu_vec_isa
    from pimm_fn import compile_step, steps
    before = cpu_vec_isa.VecISA.check_build
    compile_step(steps.supervised())
    untouched = cpu_vec_isa.VecISA.check_build is before
    os.environ["PIMM_FN_ISA_MEMO"] = "1"
    compile_step(steps.supervised())
    print(untouched, cpu_vec_isa.VecISA.check_build is before)
    """
    env = {k: v for k, v in os.environ.items() if k != "PIMM_FN_ISA_MEMO"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**env, "XDG_CACHE_HOME": str(tmp_path)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True False"
