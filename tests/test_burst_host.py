"""`python -m benchmarks.burst_host`: the host's side of a burst of shared-prefix prompts."""

from __future__ import annotations

from benchmarks import burst_host


def test_the_router_starts_every_prompt_and_later_ones_find_their_system_prompt_cached():
    admit_s, leases = burst_host.router_leases(groups=4, per_group=4, system_len=64, question_len=16,
                                               max_tokens=256)
    assert admit_s > 0
    assert sum(n for _, n in leases) == 16 and all(t > 0 for t, _ in leases)
    # the first lease takes the groups' first prompts whole (80 tokens each, 3 fit in 256);
    # once their systems are cached the others cost 16 tokens, so a lease takes many more
    assert leases[0][1] == 3 and max(n for _, n in leases[1:]) > 3


def test_it_prints_both_sides_and_the_worker_starts_prompts_on_their_cached_systems(capsys, tiny_model_dir):
    """(worker_starts asserts that every prompt found its system prompt cached)"""
    burst_host.main(["--groups", "2", "--per-group", "3", "--system-len", "48", "--question-len", "16",
                     "--max-tokens", "256", "--lease-prompts", "4", "--repeats", "1", "--model", str(tiny_model_dir)])
    out = capsys.readouterr().out
    assert "router: " in out and "worker: a lease of 4 prompts of 64 ids (48 cached)" in out
