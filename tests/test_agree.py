"""The agreement count of `benchmarks.agree`: tokens agree up to each pair's first
difference, and a pair's tokens are its longer answer's."""

from benchmarks.agree import agreement, prompts


def test_tokens_agree_up_to_the_first_difference_of_each_pair():
    a = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    b = [[1, 2, 0, 4], [5, 6], [7, 8]]
    assert agreement(a, b) == (1, 2 + 2 + 2, 4 + 2 + 3)
    assert agreement(b, a) == agreement(a, b)


def test_the_prompts_are_the_same_for_a_seed_and_within_the_vocabulary():
    first = prompts(5, (10, 20), seed=3)
    assert first == prompts(5, (10, 20), seed=3) != prompts(5, (10, 20), seed=4)
    assert all(32 <= len(p) <= 256 and set(p) <= set(range(10, 20)) for p in first)
