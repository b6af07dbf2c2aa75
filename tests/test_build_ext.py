"""csrc/build_ext.py's arguments: a --python-include folder without Python.h is refused before
anything is compiled (a build against the wrong Python headers only fails when the GPU machine
loads it)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_python_include_without_python_h_is_refused(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "csrc", "build_ext.py"), str(tmp_path / "out"),
                          "--python-include", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert f"--python-include {tmp_path}: no Python.h there" in run.stderr
    assert not (tmp_path / "out").exists(), "the output folder was made before the argument was checked"


def test_ops_namespace_that_is_not_an_identifier_is_refused(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "csrc", "build_ext.py"), str(tmp_path / "out"),
                          "--ops-namespace", "2nd-build"], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "--ops-namespace 2nd-build: not a C identifier" in run.stderr
    assert not (tmp_path / "out").exists(), "the output folder was made before the argument was checked"
