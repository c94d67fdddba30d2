"""Freed host memory kept for the next step (``dtrain.host_memory``): glibc's thresholds fixed, or left
alone where the user chose, and the start-up line naming which."""
import ctypes
import json
import subprocess
import sys
import textwrap

import pytest

from dtrain.host_memory import keep_freed_host_memory, reason_to_leave_allocator
from tests.helpers.mpi import plain_environment, with_repository_on_path

# allocates and frees 24 MiB through malloc and prints where it came from (glibc's mallinfo2)
_PROBE = textwrap.dedent("""
    import ctypes, json, sys
    from dtrain.host_memory import keep_freed_host_memory, reason_to_leave_allocator
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    choice = keep_freed_host_memory(sys.argv[1] == "kept")
    before = libc.mallinfo2()
    block = libc.malloc(24 << 20)
    during = libc.mallinfo2()
    libc.free(block)
    after = libc.mallinfo2()
    print(json.dumps({"kept": choice.kept, "mmapped": during.hblkhd - before.hblkhd,
                      "heap_kept_after_free": after.arena - before.arena}))
""")


def _probe(setting: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, setting], capture_output=True, text=True, timeout=60,
                          env=with_repository_on_path(plain_environment()))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


glibc_only = pytest.mark.skipif(reason_to_leave_allocator() is not None or not hasattr(ctypes.CDLL(None), "mallinfo2"),
                                reason="needs glibc 2.33 or later, without the user's own allocator settings")


@glibc_only
def test_kept_a_large_block_comes_from_the_heap_and_stays_after_free():
    assert _probe("kept") == {"kept": True, "mmapped": 0, "heap_kept_after_free": pytest.approx(24 << 20, rel=0.1)}


@glibc_only
def test_glibc_defaults_map_a_large_block_and_return_it():
    found = _probe("glibc")
    assert (found["kept"], found["mmapped"] >= 24 << 20, found["heap_kept_after_free"] < 1 << 20) == (False, True, True)


@pytest.mark.parametrize("environment, reason", [
    ({"MALLOC_TRIM_THRESHOLD_": "1000000"}, "MALLOC_TRIM_THRESHOLD_ set in the environment"),
    ({"MALLOC_MMAP_THRESHOLD_": "1", "MALLOC_TOP_PAD_": "1"},
     "MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_ set in the environment"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "GLIBC_TUNABLES set in the environment"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc in LD_PRELOAD"),
])
def test_the_users_own_allocator_settings_are_left_alone(environment, reason):
    choice = keep_freed_host_memory(True, environment=environment, libc_version="glibc 2.36")
    assert (choice.kept, choice.reason) == (False, reason)


def test_off_and_other_c_libraries_leave_the_allocator():
    assert keep_freed_host_memory(False).describe() == \
        "host memory: allocator left as it is (session.keep_host_memory=false)"
    assert keep_freed_host_memory(True, environment={}, libc_version="").reason == "C library unknown, not glibc"
