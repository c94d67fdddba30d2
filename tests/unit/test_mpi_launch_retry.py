"""``run_mpi`` runs a launch once more only when ``mpiexec`` failed before starting any rank."""
import stat

from tests.helpers import mpi


def _fake_mpiexec(tmp_path, failures: int, message: str, exit_code: int = 213):
    """An ``mpiexec`` that fails ``failures`` times with ``message``, then runs its command."""
    counter = tmp_path / "launches"
    script = tmp_path / "mpiexec"
    script.write_text(f"""#!/bin/bash
[ "$1" = "--version" ] && exit 0
echo x >> {counter}
if [ $(wc -l < {counter}) -le {failures} ]; then echo "{message}" >&2; exit {exit_code}; fi
shift 2; exec "$@"
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, counter


def _launches(counter) -> int:
    return len(counter.read_text().splitlines())


def test_a_launcher_failure_is_launched_once_more(tmp_path, monkeypatch):
    script, counter = _fake_mpiexec(tmp_path, 1, "The PMIx server's listener thread failed to start")
    monkeypatch.setenv("DTRAIN_MPIEXEC", str(script))
    result = mpi.run_mpi(2, ["-c", "print('ran')"], timeout=60)
    assert (result.returncode, result.stdout.strip(), _launches(counter)) == (0, "ran", 2)


def test_a_launcher_that_fails_twice_reports_the_second_failure(tmp_path, monkeypatch):
    script, counter = _fake_mpiexec(tmp_path, 2, "The PMIx server's listener thread failed to start")
    monkeypatch.setenv("DTRAIN_MPIEXEC", str(script))
    result = mpi.run_mpi(2, ["-c", "print('ran')"], timeout=60)
    assert (result.returncode, _launches(counter)) == (213, 2)
    assert "listener thread failed to start" in result.stderr


def test_any_other_failure_is_not_run_again(tmp_path, monkeypatch):
    script, counter = _fake_mpiexec(tmp_path, 1, "a rank exited with status 1", exit_code=1)
    monkeypatch.setenv("DTRAIN_MPIEXEC", str(script))
    result = mpi.run_mpi(2, ["-c", "print('ran')"], timeout=60)
    assert (result.returncode, _launches(counter)) == (1, 1)
