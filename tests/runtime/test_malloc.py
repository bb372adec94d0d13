"""meshfold.runtime.malloc: after retain_freed_memory, a large buffer freed and allocated again is not
page-faulted in again once the heap has settled (counted with the kernel's minor-fault counter,
not timed), and the heap it settles at stays bounded."""

import subprocess
import sys
import textwrap

import pytest

from meshfold.runtime.malloc import retain_freed_memory

# Each child allocates, fills and frees a 64 MiB tensor (16384 pages of 4 KiB) 30 times to let the
# heap settle (the small tensor objects allocated between the big ones split freed blocks for a
# few rounds, so the heap grows to a few buffers' size first), then prints the minor page faults
# of 3 more rounds and its resident size in MiB. glibc's default maps and unmaps it every round.
_CHILD = textwrap.dedent("""
    import resource, sys, torch
    from meshfold.runtime.malloc import retain_freed_memory
    if sys.argv[1] == "retain":
        assert retain_freed_memory()
    for _ in range(30):
        torch.empty(16 << 20).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        torch.empty(16 << 20).fill_(1.0)
    rss_mib = int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, rss_mib)
""")


def _faults_and_rss(policy: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _CHILD, policy], capture_output=True, text=True, check=True)
    faults, rss = out.stdout.strip().splitlines()[-1].split()
    return int(faults), int(rss)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt and ru_minflt are Linux-only")
def test_retained_memory_is_reused_without_page_faults():
    pages = (64 << 20) // 4096
    (system, rss_system), (retain, rss_retain) = _faults_and_rss("system"), _faults_and_rss("retain")
    assert system >= 3 * pages * 0.9, f"glibc's default should fault every reuse in again ({system} faults)"
    assert retain < pages * 0.05, f"retained memory faulted {retain} times over 3 reuses of {pages} pages"
    assert rss_retain < rss_system + 16 * 64, f"the settled heap is {rss_retain} MiB ({rss_system} by default)"


@pytest.mark.parametrize("bad", [0, -1, 1.5, "1GiB"])
def test_bad_threshold_is_refused_with_its_value(bad):
    with pytest.raises(ValueError, match="positive number of bytes"):
        retain_freed_memory(bad)
