"""How much of a reply survives the text round trip that a chat client puts it through: ids
decoded to text and that text tokenized again, as the next turn of a conversation sends it.

A prefix cache (and the host tier) finds a later turn's reply only as far as the ids agree.
Random ids stand for what a random-weight model writes; a sentence for a trained model's.

    python docs/bench/roundtrip.py TOKENIZER_DIR [REPLIES] [LENGTH]
"""

from __future__ import annotations

import random
import sys

from transformers import AutoTokenizer


def agreeing(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    path, replies, length = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200, \
        int(sys.argv[3]) if len(sys.argv) > 3 else 100
    tok = AutoTokenizer.from_pretrained(path)
    rng = random.Random(0)
    kept = sorted(agreeing(ids, tok.encode(tok.decode(ids), add_special_tokens=False))
                  for ids in ([rng.randrange(10, min(tok.vocab_size, 31000)) for _ in range(length)]
                              for _ in range(replies)))
    print(f"random ids: of {length}, the agreeing prefix has p50 {kept[len(kept) // 2]}, "
          f"p90 {kept[int(0.9 * len(kept))]}; {sum(k == length for k in kept)} of {replies} whole")
    text = ("The capital of France is Paris. It is known for the Eiffel Tower, museums such as the Louvre, "
            "and its cafes.")
    ids = tok.encode(text, add_special_tokens=False)
    print(f"a sentence of {len(ids)} ids: {agreeing(ids, tok.encode(tok.decode(ids), add_special_tokens=False))} agree")


if __name__ == "__main__":
    main()
