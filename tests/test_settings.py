"""Every setting and machine probe lives in minengine.settings: nobody else reads the environment or
/proc, each setting says where its value came from, and `reqscope env`, --json and traces list them."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from minengine import omp_env, settings
from minengine.fast import cpu_kernels
from minengine.fast.panel_kernels import activations_setting, amx_setting
from minengine.record.trace_io import TraceHeader, read_trace, write_trace
from reqscope import cli

ROOT = Path(__file__).resolve().parent.parent
READ_ATTRIBUTES = {"environ", "environb", "getenv", "putenv", "unsetenv"}  # os's ways into the environment
PROC_FILES = ("/proc/cpuinfo", "/proc/stat", "/proc/meminfo")

# The files that may read the environment or /proc themselves, and why. Each must still do so
# (`test_every_exception_is_still_needed`), so a fixed one cannot stay listed. The app's variables
# (the API keys, COLUMNS, the bench children's OMP_WAIT_POLICY) are read through `settings.read_env`
# too; a key is marked secret there, so `reqscope env` never prints it, and no setting carries it.
EXCEPTIONS = {
    "minengine/settings.py": "the one module that reads them",
}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            found.add(id(first.value))
    return found


def reads_in(source: str, name: str = "<probe>") -> list[str]:
    """`line: what` for each read of the environment or of /proc's machine files in `source`.

    Code only: a docstring or comment that names /proc/stat explains a design, it reads nothing."""
    tree = ast.parse(source, filename=name)
    os_names = {"os"} | {
        alias.asname for node in ast.walk(tree) if isinstance(node, ast.Import)
        for alias in node.names if alias.name == "os" and alias.asname
    }  # fmt: skip
    prose = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in os_names:
            if node.attr in READ_ATTRIBUTES:
                found.append(f"{node.lineno}: os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{node.lineno}: from os import {a.name}" for a in node.names if a.name in READ_ATTRIBUTES]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            found += [f"{node.lineno}: {path}" for path in PROC_FILES if path in node.value]
    return found


def _project_files() -> dict[str, Path]:
    return {
        str(path.relative_to(ROOT)): path
        for folder in ("minengine", "app")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def test_only_settings_reads_the_environment_or_probes_the_machine():
    wrong = [
        f"{name}:{read}"
        for name, path in _project_files().items()
        if name not in EXCEPTIONS
        for read in reads_in(path.read_text(), name)
    ]
    assert not wrong, "read these through minengine.settings (or list the file here, saying why):\n  " + (
        "\n  ".join(wrong)
    )


def test_every_exception_is_still_needed():
    files = _project_files()
    stale = [name for name in EXCEPTIONS if name not in files or not reads_in(files[name].read_text(), name)]
    assert not stale, f"these no longer read the environment or /proc; take them off EXCEPTIONS: {stale}"


def test_the_reader_check_catches_what_it_is_for():
    probe = (
        '"""Reads /proc/stat (prose)."""\n'
        "import os\nimport os as system\nfrom os import getenv\n"
        'a = os.environ.get("X")\nb = system.getenv("Y")\n'
        'c = open("/proc/meminfo")\n'
        "# /proc/cpuinfo in a comment\n"
        'def f():\n    """/proc/cpuinfo in a docstring"""\n    return f"/proc/cpuinfo{1}"\n'
    )
    expected = ["4: from os import getenv", "5: os.environ", "6: os.getenv", "7: /proc/meminfo", "11: /proc/cpuinfo"]
    assert sorted(reads_in(probe)) == sorted(expected)


# -- each setting says where its value came from --------------------------------------------------


@pytest.mark.parametrize(
    ("read", "variable", "value"),
    [
        (settings.float32_kernel, settings.FLOAT32_KERNEL_ENV, "dense"),
        (settings.layout_cache, settings.LAYOUT_CACHE_ENV, "0"),
        (settings.c_compiler, settings.CC_ENV, "/opt/no-such-cc"),
        (settings.models_home, settings.HOME_ENV, "/tmp/reqscope-home"),
        (settings.threads, settings.OMP_NUM_THREADS_ENV, "1"),
        (activations_setting, settings.ACTIVATIONS_ENV, "float32"),
        (amx_setting, settings.AMX_ENV, "off"),
    ],
    ids=lambda v: getattr(v, "__name__", None) if callable(v) else None,
)
def test_a_variable_set_is_the_source_and_named(monkeypatch, read, variable, value):
    for name in (variable, settings.CACHE_HOME_ENV):
        monkeypatch.delenv(name, raising=False)
    unset = read()
    assert unset.source in (settings.DEFAULT, settings.PROBE)
    assert variable not in unset.detail
    monkeypatch.setenv(variable, value)
    given = read()
    assert (given.source, given.name) == (settings.ENVIRONMENT, unset.name)
    assert variable in given.detail, given
    if read not in (settings.threads, settings.layout_cache):  # torch read OMP_NUM_THREADS at its start
        assert given.value == value


def test_a_value_the_setting_does_not_know_keeps_the_default_and_says_so(monkeypatch):
    monkeypatch.setenv(settings.FLOAT32_KERNEL_ENV, "fastest")
    found = settings.float32_kernel()
    assert (found.value, found.source) == ("panels", settings.DEFAULT)
    assert "REQSCOPE_FLOAT32_KERNEL='fastest' is none of" in found.detail
    monkeypatch.setenv(settings.ACTIVATIONS_ENV, "int4")
    assert activations_setting().source != settings.ENVIRONMENT


def test_the_openmp_policy_says_who_chose_it(monkeypatch):
    monkeypatch.setattr(omp_env, "_set_here", False)
    monkeypatch.setattr(omp_env, "_spin_here", False)
    monkeypatch.setenv(omp_env.VARIABLE, "ACTIVE")
    mine = omp_env.policy_setting()
    assert (mine.value, mine.source, mine.detail) == ("ACTIVE", settings.ENVIRONMENT, omp_env.VARIABLE)
    monkeypatch.delenv(omp_env.VARIABLE)
    monkeypatch.delenv(omp_env.SPIN_VARIABLE, raising=False)
    omp_env.prefer_passive_wait()
    chosen = omp_env.policy_setting()
    assert (chosen.value, chosen.source) == ("PASSIVE", settings.DEFAULT) and "chosen here" in chosen.detail


def test_probes_name_what_they_probed():
    assert "/proc/cpuinfo" in settings.cpu().detail and settings.cpu().source == settings.PROBE
    budget = settings.kv_budget(__import__("torch").device("cpu"))
    assert budget.source == settings.PROBE and "MemAvailable" in budget.detail and budget.value > 0
    flagged = budget.given(64 << 20, "--kv-budget-mib")
    assert (flagged.source, flagged.detail, flagged.value) == (settings.FLAG, "--kv-budget-mib", 64 << 20)
    kernels = cpu_kernels.kernels_setting()
    assert kernels.source == settings.PROBE and kernels.detail  # the library's file, or why there is none
    for probe in (settings.python, settings.torch_build, settings.cuda, settings.cpus, settings.cpu_capability_setting):
        assert probe().source in (settings.PROBE, settings.ENVIRONMENT), probe


def test_a_machine_without_the_files_gets_no_value(monkeypatch):
    real_open = open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise OSError("no /proc here")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_proc)
    settings.cpu_flags.cache_clear()
    try:
        assert settings.cpu_flags() == frozenset() and settings.machine_busy_seconds() is None
    finally:
        settings.cpu_flags.cache_clear()


# -- where the settings are shown -------------------------------------------------------------------

NAMED = {
    "python", "torch", "cuda", "cpu", "cpu_capability", "cpus", "threads", "omp_wait_policy", "c_compiler",
    "c_kernels", "kernels_home", "activations", "amx", "row_ops", "float32_kernel", "kv_budget_bytes", "layout_cache",
    "home",
}  # fmt: skip


def test_env_lists_every_setting_as_text_and_as_json(capsys):
    assert cli.main(["env", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert set(found["settings"]) == NAMED
    for name, setting in found["settings"].items():
        assert set(setting) == {"value", "default", "source", "detail"}, name
        assert setting["source"] in (settings.DEFAULT, settings.ENVIRONMENT, settings.FLAG, settings.PROBE), name
    assert found["settings"]["omp_wait_policy"]["detail"].startswith("chosen here")  # env decodes nothing
    assert cli.main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    setting_lines = lines[1 : lines.index("")]
    assert lines[0].startswith("reqscope") and {line.split()[0] for line in setting_lines} == NAMED


def test_a_trace_keeps_its_settings_and_old_traces_still_read(tmp_path):
    values = (settings.float32_kernel(), settings.cpu(), settings.SettingValue("cuda", False, None, settings.PROBE))
    header = TraceHeader("m", "d", 1, 1, 1, 8, "float32", "cpu", 1.0, settings=values)
    write_trace(tmp_path / "t.jsonl", header, [])
    assert read_trace(tmp_path / "t.jsonl")[0] == header
    old, _ = read_trace(ROOT / "tests" / "data" / "explorer-trace.jsonl")
    assert old.settings == ()


def test_the_json_run_and_its_trace_say_what_they_ran_under(chatty_tiny_dir, capsys, tmp_path):
    argv = ["--json", "--model", str(chatty_tiny_dir), "--max-tokens", "2", "--temperature", "0"]
    assert cli.main([*argv, "--kv-budget-mib", "64", "--export", str(tmp_path / "run"), "hi"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    first = records[0]
    assert first["event"] == "request" and "temperature" in first["settings"]  # the sampling, as before
    assert set(first["engine_settings"]) == NAMED | {"kernels"}  # an engine's own: which arithmetic it runs
    kernels = first["engine_settings"]["kernels"]
    assert (kernels["value"], kernels["source"]) == ("fast", "default")
    budget = first["engine_settings"]["kv_budget_bytes"]
    assert (budget["value"], budget["source"], budget["detail"]) == (64 << 20, "flag", "--kv-budget-mib")
    assert all("engine_settings" not in r for r in records if r["event"] == "token")
    header, _ = read_trace(tmp_path / "run" / "request-trace.jsonl")
    assert {s.name: s.record() for s in header.settings} == first["engine_settings"]


# -- every variable read is registered, and `reqscope env` lists it ------------------------------


READERS = ("read_env", "_env")  # settings' reader, and its own short name for it


def _read_env_arguments(source: str, name: str) -> list[tuple[int, str]]:
    """`(line, what)` for each `read_env(X)` call in `source`: X's constant name, or its literal text."""
    found = []
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in READERS:
            arg = node.args[0] if node.args else None
            what = arg.id if isinstance(arg, ast.Name) else arg.attr if isinstance(arg, ast.Attribute) else None
            found.append((node.lineno, what if what else ast.unparse(arg) if arg is not None else ""))
    return found


def test_every_variable_read_is_one_settings_registers():
    registered = {v.name for v in settings.VARIABLES}
    constants = {name: getattr(settings, name) for name in dir(settings) if name.endswith("_ENV")}
    assert set(constants.values()) == registered, "each *_ENV constant of settings is one of its VARIABLES"
    wrong = []
    reads = 0
    for name, path in _project_files().items():
        for line, what in _read_env_arguments(path.read_text(), name):
            reads += 1
            if constants.get(what) not in registered:
                wrong.append(f"{name}:{line}: read_env({what})")
    assert not wrong, "name the variable by a settings *_ENV constant that VARIABLES lists:\n  " + "\n  ".join(wrong)
    assert reads >= 9  # the settings' own, the two API keys (three readers), COLUMNS and the children's policy


def test_read_env_refuses_a_variable_the_registry_lacks(monkeypatch):
    monkeypatch.setenv("REQSCOPE_NOT_A_SETTING", "1")
    with pytest.raises(KeyError, match="REQSCOPE_NOT_A_SETTING is not in minengine.settings.VARIABLES"):
        settings.read_env("REQSCOPE_NOT_A_SETTING")
    monkeypatch.setenv(settings.COLUMNS_ENV, "77")
    assert settings.read_env(settings.COLUMNS_ENV) == "77"


def test_env_lists_every_variable_and_never_prints_a_key(monkeypatch, capsys):
    monkeypatch.setenv(settings.CLIENT_API_KEY_ENV, "sk-do-not-print")
    monkeypatch.delenv(settings.SERVE_API_KEY_ENV, raising=False)
    monkeypatch.setenv(settings.COLUMNS_ENV, "91")
    assert cli.main(["env", "--json"]) == 0
    out = capsys.readouterr().out
    assert "sk-do-not-print" not in out
    found = json.loads(out)["environment"]
    assert list(found) == [v.name for v in settings.VARIABLES]
    assert found[settings.CLIENT_API_KEY_ENV] == {"set": True, "value": None, "sets": found["OPENAI_API_KEY"]["sets"]}
    assert found[settings.SERVE_API_KEY_ENV]["set"] is False
    assert found[settings.COLUMNS_ENV]["value"] == "91"
    assert cli.main(["env"]) == 0
    text = capsys.readouterr().out
    assert "sk-do-not-print" not in text
    listed = text.split("environment variables read:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in listed] == [v.name for v in settings.VARIABLES]
    said = {line.split()[0]: line.split()[1] for line in listed}
    assert (said["OPENAI_API_KEY"], said["REQSCOPE_API_KEY"], said["COLUMNS"]) == ("set", "not", "'91'")
