"""tools/kernels/mutants.py: the rules find their sites in the code and nowhere else; the planted bugs
that once passed all of CI are killed by the kernel checks; every survivor of the last full run
is explained; and a seeded sample of the mutants that run killed by the tests is killed again
(the seed is printed: rerun it with MT_MUTANT_SEED=<seed>)."""

import ast
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from minitransformer import settings
from minitransformer.emulated import emulator

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools" / "kernels"))
import mutants  # noqa: E402

pytestmark = pytest.mark.slow  # the mutation tester: planted bugs and a sample of mutants


def sites(rule, source: str) -> list[str]:
    """``source`` after each of the rule's mutations."""
    code = mutants.code_only(source)
    return [source[:a] + new + source[b:] for a, b, new in mutants.RULES[rule](code)]


def test_code_only_blanks_comments_strings_and_directives():
    source = ('#include <cuda_fp16.h>\nint a = 1; // a < b\n/* x > y */ f("i < n", \'<\');\n'
              '#define M(x) \\\n    (x < 1)\nint b = a < 2;\n')
    code = mutants.code_only(source)
    assert len(code) == len(source) and code.count("\n") == source.count("\n")
    assert code.count("<") == 1 and "a < 2" in code


def test_relational_operators_but_not_templates_shifts_or_launches():
    source = "if (i < n && j >= m) x = a > b; load_tile<T, D, BR>(s); k<<<g, b>>>(p); o >>= 1;\n"
    assert sites("relational", source) == [
        "if (i <= n && j >= m) x = a > b; load_tile<T, D, BR>(s); k<<<g, b>>>(p); o >>= 1;\n",
        "if (i < n && j > m) x = a > b; load_tile<T, D, BR>(s); k<<<g, b>>>(p); o >>= 1;\n",
        "if (i < n && j >= m) x = a >= b; load_tile<T, D, BR>(s); k<<<g, b>>>(p); o >>= 1;\n"]


def test_bounds_and_min_max_calls_but_not_definitions():
    source = ("__device__ int min(int a, int b);\nint q_end = min(T, q0 + BR);\n"
              "x = max(a, b) * 2;\nreturn max(c, d);\n")
    got = sites("off-by-one", source)
    assert "int q_end = min(T, q0 + BR) + 1;" in got[0] and "int q_end = min(T, q0 + BR) - 1;" in got[1]
    assert any("x = (max(a, b) + 1) * 2;" in s for s in got) and any("return (max(c, d) - 1);" in s for s in got)
    assert not any("int (min(int a" in s or "int min(int a, int b) " in s for s in got)
    assert len(got) == 6  # q_end +- 1 (its min is not mutated twice), max(a, b) +- 1, max(c, d) +- 1
    swapped = sites("min-max", source)
    assert len(swapped) == 3 and "int q_end = max(T, q0 + BR);" in swapped[0]


def test_barriers_atomics_pipelines():
    assert sites("barrier", "a();\n__syncthreads();\nb();\n") == ["a();\n\nb();\n"]
    assert sites("atomic", "atomicAdd(dq + size_t(r) * D, acc[h][0]);") == ["*(dq + size_t(r) * D) += acc[h][0];"]
    assert sites("pipeline", "__pipeline_wait_prior(1); __pipeline_commit();") == [
        "__pipeline_wait_prior(2); __pipeline_commit();", "__pipeline_wait_prior(0); __pipeline_commit();",
        "__pipeline_wait_prior(1); "]


def test_the_online_maximum_dropped_and_the_rescale_applied_twice_or_not_at_all():
    source = ("acc = maxsum_add(acc, z);\nconst float m_new = fmaxf(m_row, tile_max);\n"
              "l = l * alpha + s;\no[d] *= alpha;\n")
    got = sites("online-max", source)
    assert "acc = MaxSum{0.f, (acc).s + exp_diff(z, 0.f)};" in got[0]
    assert "const float m_new = 0.f;" in got[1]
    assert {"o[d] *= alpha;" in s for s in got[2:]} == {True, False}
    assert any("l = l + s;" in s for s in got) and any("l = l * alpha * alpha + s;" in s for s in got)
    assert any("\n\n" in s[s.index("alpha + s;"):] for s in got)  # the *= statement removed


def test_rounding_made_directed_at_every_16_bit_conversion_packed_pairs_too():
    source = ("return __float2half_rn(v);\n__half2 h = __floats2half2_rn(lo, hi);\n"
              "__device__ __half __float2half_rn(float v);\n")
    got = sites("rounding", source)
    assert [s.splitlines()[0] for s in got[:3]] == [f"return __float2half_{m}(v);" for m in ("rz", "rd", "ru")]
    assert [s.splitlines()[1] for s in got[3:]] == [
        f"__half2 h = __halves2half2(__float2half_{m}(lo), __float2half_{m}(hi));" for m in ("rz", "rd", "ru")]
    assert len(got) == 6  # not the declaration


def test_valid_length_widened_to_the_padded_one_and_the_reverse():
    source = ("const int kv_len = p.kv_lens ? min(max(p.kv_lens[b], 0), p.S) : p.S;\n"
              "load(sK, min(BC, kv_len - k0));\nconst int k_valid = min(BC, p.S - k0);\n"
              "for (int j = 0; j < end; ++j) acc += w[j];\n")
    got = sites("valid-length", source)
    assert any("load(sK, min(BC, p.S - k0));" in s for s in got)
    assert any("min(max(p.S, 0), p.S)" in s for s in got)
    assert any("const int k_valid = min(BC, kv_len - k0);" in s for s in got)
    assert any("for (int j = 0; j < S; ++j)" in s for s in got)
    assert not any("const int p.S =" in s for s in got) and len(got) == 4


def test_index_swaps_batch_head_row_column_and_grid_axes():
    source = "const int bh = blockIdx.y, b = bh / p.H;\nint r = idx / D, d = idx % D;\nx = a / n;\n"
    got = sites("index-swap", source)
    assert "b = bh % p.H;" in got[0] and "b = bh % p.B;" in got[3]
    assert "int r = idx % D, d = idx % D;" in got[1] and "int r = idx / D, d = idx / D;" in got[2]
    assert "const int bh = blockIdx.x," in got[4]
    assert len(got) == 5  # not a / n: n is no dimension


def test_constants_label_smoothing_share_log2e_and_scale():
    source = ("const float off = smoothing / V;\nreturn exp2f((x - m) * kLog2e);\n"
              "float s = sS[c] * p.scale;\nacc = maxsum_add(acc, scale * z);\n")
    got = sites("constant", source)
    assert "const float off = smoothing / (V - 1);" in got[0] and "return exp2f((x - m));" in got[1]
    assert "float s = sS[c];" in got[2] and "float s = sS[c] * (2.f * p.scale);" in got[3]
    assert "maxsum_add(acc, z);" in got[4] and "maxsum_add(acc, 2.f * scale * z);" in got[5]
    assert len(got) == 6


def test_every_rule_finds_sites_in_csrc_and_each_mutant_is_one_change():
    found = mutants.generate()
    assert {m.rule for m in found} == set(mutants.RULES)
    for m in found:
        assert (mutants.CSRC / m.file).read_text()[m.start:m.end] == m.old
        mutation = m.mutation()
        assert mutation.new.count("\n") - mutation.old.count("\n") == m.new.count("\n") - m.old.count("\n")
    assert len({(m.file, m.start, m.end, m.new) for m in found}) == len(found)


def test_the_ledger_names_existing_mutants_and_says_why():
    """Every entry of mutants_equivalent.toml is a mutant of the sources as they are, with a
    reason; at most a tenth of a kernel's mutants are called equivalent. A kernel's mutants
    are those of its .cu file and of common.cuh, which every kernel includes, less those that
    compile to the unmutated code (as the record of the full run shows)."""
    found = mutants.generate()
    for kind in ("equivalent", "survivor"):
        for e in mutants.equivalents(kind):
            assert len(e["reason"]) > 40, e
            matched = [m.name for m in found if mutants.equivalent_reason(m, [e])]
            assert len(matched) == 1, f"{e} is {len(matched)} mutants (name its line): {matched}"
    entries = mutants.equivalents()
    recorded = mutants.load_record(mutants.RECORD)["mutants"]
    for file in mutants.FILES:
        if file == "common.cuh":
            continue
        of_kernel = [m for m in found if m.file in (file, "common.cuh")
                     and recorded.get(m.name, {}).get("status") != "identical"]
        listed = sum(1 for m in of_kernel if mutants.equivalent_reason(m, entries))
        assert listed <= 0.10 * len(of_kernel), f"{listed} of {len(of_kernel)} mutants of {file} and common.cuh called equivalent"


def test_every_survivor_of_the_last_full_run_is_explained():
    """The record of the full run (tools/kernels/mutants_record.json): each mutant it saw survive
    is listed, as equivalent or as a survivor with its reason."""
    record = mutants.load_record(mutants.RECORD)
    entries = mutants.equivalents() + mutants.equivalents("survivor")
    by_name = {m.name: m for m in mutants.generate()}
    survived = [n for n, r in record["mutants"].items() if r["status"] == "survived"]
    unexplained = [n for n in survived if n in by_name and not mutants.equivalent_reason(by_name[n], entries)]
    assert not unexplained, "survivors of the full run that mutants_equivalent.toml does not explain:\n" + "\n".join(unexplained)


def test_the_ledger_lists_no_mutant_the_last_full_run_killed():
    """An entry whose mutant a check now kills is stale: its reason no longer holds (the
    record says which check kills it)."""
    record = mutants.load_record(mutants.RECORD)
    entries = mutants.equivalents() + mutants.equivalents("survivor")
    killed = [f"{m.name} (by {record['mutants'][m.name]['by']})" for m in mutants.generate()
              if record["mutants"].get(m.name, {}).get("status") == "killed" and mutants.equivalent_reason(m, entries)]
    assert not killed, "mutants_equivalent.toml lists mutants the full run killed:\n" + "\n".join(killed)


def test_a_sample_draws_only_what_the_record_vouches_for():
    found = mutants.generate()[:4]
    record = {"complete": False, "mutants": {found[0].name: {"status": "killed"}, found[1].name: {"status": "survived"}}}
    assert mutants.eligible_for_sample(found, [], record) == [found[0]]
    record["complete"] = True  # then a mutant it lacks is new in the sources: drawn too
    assert mutants.eligible_for_sample(found, [], record) == [found[0], found[2], found[3]]
    # A quick sample (CI's) draws only what the record shows killed by the tests: not by a
    # sanitizer, and nothing it does not know, whose cost and fate it cannot tell.
    record["mutants"][found[0].name]["by"] = "kernel tests"
    record["mutants"][found[1].name] = {"status": "killed", "by": "device tests"}
    assert mutants.eligible_for_sample(found, [], record, quick=True) == [found[0], found[1]]
    record["mutants"][found[0].name]["by"] = "thread sanitizer"
    assert mutants.eligible_for_sample(found, [], record, quick=True) == [found[1]]
    # A record made before a rule class existed vouches for none of its mutants.
    new = dataclasses.replace(found[3], rule="a class added since")
    record = {"complete": False, "rules": [found[2].rule], "mutants": {}}
    assert found[2].rule != new.rule and mutants.eligible_for_sample([found[2], new], [], record) == [found[2]]


needs_emulator = pytest.mark.skipif(
    any(emulator.unavailable_reason(s) for s in (None, *emulator.SANITIZERS)) and not settings.env_flag("MT_REQUIRE_EMULATOR"),
    reason="the emulator (with its sanitizers) cannot build csrc/ here")


def run_mutants(*args, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "kernels" / "mutants.py"), "--jobs", "2",
                           "--results", str(tmp_path / "results.jsonl"), *args],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)


# The five realistic bugs that passed all of CI before the tile-boundary and value-range checks
# (the causal key bound one short in both forwards, the float32 backward's first query one late,
# softmax's and cross-entropy's maximum dropped): each must be killed by the kernel tests.
PLANTED = [r"off-by-one: min\(k_end, min\(q0 \+ BR, p.T\) \+ \(p.S - p.T\)\) -> .* - 1$",
           r"off-by-one: p.causal \? max\(0, k0 - \(p.S - p.T\)\) : 0 -> .* \+ 1$",
           r"online-max: maxsum_add\(acc, "]


# The checks of issue 43's section 2: fixed boundary, decoding and range cases, and the
# hypothesis draws of lengths near tile multiples (test_attention_kernels), which find them too.
BOUNDARY_AND_RANGE_CHECKS = (r"::test_(\w+_(at_every_tile_boundary|as_decoding_calls_them|past_exps_range|across_the_range)"
                             r"|attention_kernels)\[")


@needs_emulator
def test_the_planted_bugs_that_once_passed_ci_are_killed_by_the_kernel_tests(tmp_path):
    run = run_mutants("--match", "|".join(f"({p})" for p in PLANTED), tmp_path=tmp_path)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("[")]
    assert len(lines) == 5 and all(" killed kernel tests " in line for line in lines), "\n".join(lines)
    # ... by the checks at the tile boundaries and across the value range, which exercise the
    # kernels' numbers, not by a test that looks for these bugs; which one finds a bug first
    # depends on the draws.
    for record in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines()):
        failed = [line for line in record["evidence"].splitlines() if line.startswith("FAILED")]
        assert all(re.search(BOUNDARY_AND_RANGE_CHECKS, line) for line in failed), record


@needs_emulator
def test_a_seeded_sample_of_the_mutants_is_killed(tmp_path):
    seed = int(os.environ.get("MT_MUTANT_SEED") or random.SystemRandom().randrange(2**32))
    print(f"mutant sample seed {seed}: rerun with MT_MUTANT_SEED={seed}")
    run = run_mutants("--sample", "1", "--quick", "--seed", str(seed), tmp_path=tmp_path)
    assert run.returncode == 0, f"seed {seed}:\n" + run.stdout[-6000:] + run.stderr[-2000:]
    assert f"seed {seed}" in run.stdout


@pytest.mark.skipif(emulator.cuda_home() is None and not settings.env_flag("MT_REQUIRE_EMULATOR"),
                    reason="no CUDA toolkit (nvcc) here")
def test_a_carve_shortened_into_its_last_rows_padding_is_identical_on_the_gpu_and_a_longer_one_is_not(monkeypatch):
    """Trivial compiler equivalence, on one architecture to keep it short: the float32
    forward's Q tile carved one float shorter compiles to the very PTX and object file (the
    carver rounds to 128 bytes, and the float is the last row's padding), one float longer
    moves every later array."""
    monkeypatch.setattr(emulator.setup_module(), "DEFAULT_ARCHS", [90])
    shorter, longer = (next(m for m in mutants.generate() if m.name == f"attention.cu:318:27 tile: BR * L::LDT -> BR * L::LDT {s} 1")
                       for s in "-+")
    assert mutants.same_gpu_build(shorter.mutation())
    assert not mutants.same_gpu_build(longer.mutation())


@needs_emulator
def test_an_index_past_a_local_array_is_killed_though_nvcc_folds_it_away(tmp_path):
    """store_pack's loop one element past its VEC-element array: undefined behaviour, which
    nvcc (and g++ -O2) compile to the unmutated code by assuming it never happens. The
    sanitizers run before the comparison with nvcc's build, and UBSan reports the index."""
    run = run_mutants("--match", r"^layernorm\.cu:54:23 relational: < -> <=$", tmp_path=tmp_path)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("[")]
    assert len(lines) == 1 and " killed address sanitizer " in lines[0], "\n".join(lines)


def test_a_kill_is_confirmed_by_its_failed_test_passing_unmutated_once(tmp_path, monkeypatch):
    """Only the failed test runs again, unmutated, and its pass is kept for the next run on the
    same sources and checks; a kill that names no failed test (a crash), or names one pytest
    cannot find, runs the whole check; a failure is told to every mutant the check kills, and
    the check is not run again."""
    monkeypatch.setattr(emulator, "CACHE", tmp_path)
    monkeypatch.setattr(emulator, "compile_variant", lambda *args: tmp_path / "module")
    monkeypatch.setattr(mutants, "_baseline_failed", {})
    mutants._baseline_mark.cache_clear()  # its paths are under CACHE as patched here
    ran = []

    def run(cmd, **kwargs):
        ran.append(cmd[-1])
        code = {"a.py::fails": 1, "a.py::lost[x": 4}.get(cmd[-1], 0)
        return subprocess.CompletedProcess(cmd, code, "1 failed", "")

    monkeypatch.setattr(mutants.subprocess, "run", run)
    stage = ["pytest", "-x", "a.py", "b.py", "-m", "emulator"]
    killed = "...\nFAILED a.py::passes[float32] - AssertionError: ...\n1 failed, 3 passed in 2.00s"
    for _ in range(2):
        mutants.confirm_kill("softmax.cu", "kernel tests", stage, killed)
    assert ran == ["a.py::passes[float32]"]
    mutants.confirm_kill("softmax.cu", "kernel tests", stage, "Fatal Python error: Segmentation fault")
    mutants.confirm_kill("softmax.cu", "kernel tests", stage, "FAILED a.py::lost[x y] - a space in its id")
    assert ran == ["a.py::passes[float32]", "emulator", "a.py::lost[x"]  # the whole stage's pass is kept
    for _ in range(2):
        with pytest.raises(mutants.ChecksFail, match=r"the kernel tests \(a.py::fails\) of softmax.cu fail on csrc/ as it is"):
            mutants.confirm_kill("softmax.cu", "kernel tests", stage, "FAILED a.py::fails - AssertionError")
    assert ran[3:] == ["a.py::fails"]
    monkeypatch.setattr(mutants, "_baseline_failed", {})  # a second run: the passes are remembered
    mutants.confirm_kill("softmax.cu", "kernel tests", stage, killed)
    mutants.confirm_kill("softmax.cu", "kernel tests", stage, "no end: over 180 CPU seconds")
    assert ran[4:] == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_check_ended_by_an_interrupt_is_no_kill(monkeypatch, signum):
    """Ctrl-C reaches the checks too (the terminal's process group), and a kill sent to a check
    must not be recorded as the mutant's: the run stops with nothing recorded for it."""
    monkeypatch.setattr(emulator, "run_limited", lambda cmd, *a, **k: subprocess.CompletedProcess(cmd, -signum, "", ""))
    with pytest.raises(KeyboardInterrupt, match="interrupted"):
        mutants._failure(["pytest", "-x"], 1, 1, {}, ROOT, pytest=True)
    monkeypatch.setattr(emulator, "run_limited", lambda cmd, *a, **k: subprocess.CompletedProcess(cmd, -signal.SIGSEGV, "", ""))
    assert mutants._failure(["pytest", "-x"], 1, 1, {}, ROOT, pytest=True) == ""  # a crash is the mutant's


def test_the_record_keeps_only_results_of_the_sources_and_checks_as_they_are(tmp_path):
    every = mutants.generate()
    m = every[0]
    path = tmp_path / "record.json"
    path.write_text(json.dumps({"complete": False, "mutants": {
        every[1].name: {"status": "killed", "by": "kernel tests", "key": "of-other-checks", "seconds": 1.0}}}))
    current = mutants.key(m, mutants.csrc_texts())
    outcome = {"status": "killed", "by": "kernel tests", "key": current, "seconds": 2.0, "mutant_obj": m}
    mutants.write_record(path, {m.name: outcome}, every, [])
    record = json.loads(path.read_text())
    assert list(record["mutants"]) == [m.name] and not record["complete"]


def test_a_mutants_checks_are_its_stages_files_and_what_they_import():
    """A result is kept while its checks are unchanged, so every test module that a mutant's
    stages run or import is among the files hashed for it; another kernel's tests, and
    tests/helpers.py, which no stage imports, are not, so that a change there tests nothing
    again."""
    local = {p.stem: p for d in (ROOT / "tests", mutants.TESTS) for p in d.glob("*.py")}
    for file in mutants.FILES:
        hashed = set(mutants.checks_paths(file))
        staged = {Path(a) for _, cmd in mutants.test_stages([file]) for a in cmd if a.endswith(".py")}
        staged |= {Path(a) for a in mutants.cost_stage([file]) or [] if a.endswith(".py")}
        staged.add(mutants.TESTS / "sanitized_run.py")
        assert staged <= hashed, (file, staged - hashed)
        for path in staged:  # and what they import, parsed here on its own
            tree = ast.parse(path.read_text())
            names = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
            names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
            assert {local[n] for n in names if n in local} <= hashed, (file, path)
        assert ROOT / "tests" / "helpers.py" not in hashed
    assert mutants.TESTS / "test_attention.py" not in mutants.checks_paths("layernorm.cu")
    assert mutants.TESTS / "test_layernorm.py" in mutants.checks_paths("common.cuh")
    assert mutants.TESTS / "test_costs.py" in mutants.checks_paths("attention.cu")
    assert mutants.TESTS / "test_costs.py" not in mutants.checks_paths("softmax.cu")

def test_results_that_are_not_a_regular_file_are_refused_before_any_work(tmp_path):
    """A FIFO given as --results would block the resume that reads it back."""
    fifo = tmp_path / "results.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"--results .*results\.fifo is not a regular file"):
        mutants.main(["--results", str(fifo), "--list"])
