"""`qmigrate bench quality`: what FP8 weights or an FP8 KV cache cost in output quality on a
trained model (SmolLM2 by default), each variant against the model's own dtype.

Two measures, the engine driven directly in this process:
- greedy agreement: 48 chat prompts (fixed, made from the topics below), NEW_TOKENS tokens
  each, greedy, EOS ignored; answers identical to the baseline's, and the mean share of each
  answer that agrees with the baseline's up to its first difference (a difference changes
  everything after it, so the tokens past it count as disagreeing);
- perplexity on a fixed text (TEXT below), teacher-forced: the text cut into ROWS rows, one
  token per row and step through the engine's decode path, each next token's log-probability
  read off the step's logits.
"""

from __future__ import annotations

import gc
import json
import math
import sys
from pathlib import Path

import torch

NEW_TOKENS = 64
ROWS = 4

TOPICS = (
    "photosynthesis", "the water cycle", "how vaccines work", "black holes", "the French Revolution",
    "compound interest", "machine learning", "plate tectonics", "the immune system", "the stock market",
    "climate change", "the Roman Empire", "how airplanes fly", "the internet", "DNA", "volcanoes",
    "the moon landing", "renewable energy", "the printing press", "sleep", "gravity", "inflation",
    "the human heart", "coral reefs", "electric cars", "the Renaissance", "earthquakes", "bees",
    "the solar system", "democracy", "antibiotics", "rainbows", "the Great Wall of China", "recycling",
    "memory", "chess", "coffee", "the Olympic Games", "tides", "batteries", "dinosaurs", "music theory",
    "the speed of light", "bread making", "glaciers", "the periodic table", "friendship", "deserts",
)
TEMPLATES = ("Explain {} in simple terms.", "Write three short facts about {}.",
             "Why is {} important?", "Give a short summary of {} for a student.")

TEXT = """\
The river town woke slowly in the early autumn. Before the sun cleared the hills, the baker had
already lit his ovens, and the smell of warm bread drifted along the narrow streets toward the
harbour. Fishermen untied their boats and rowed out past the old stone pier, calling to one another
across the still water. In the market square, farmers set up their stalls with apples, pears,
cabbages and baskets of late tomatoes, while children ran between the tables before school.

The town had been built where two rivers met, and for centuries its people had lived from trade.
Barges carried grain, timber and wool down to the coast, and merchants returned with salt, spices
and cloth. The old customs house still stood beside the bridge, although it now held a small museum
where visitors could see maps, ledgers and the brass scales once used to weigh every cargo that
passed. A teacher from the school led her class through the rooms each spring, explaining how taxes
on the river trade had paid for the town hall, the hospital and the first public library.

Life changed when the railway arrived. Goods that had taken a week to reach the sea by water now
travelled in a single day, and many of the barge owners sold their boats. Some families left for
the cities, where factories offered steady wages, while others opened shops, inns and workshops to
serve the travellers who stepped off the trains. The station became the new centre of the town,
and a wide road was built from its doors to the market square.

Today the rivers are quiet again. The barges are gone, but small boats carry tourists along the
banks in summer, and anglers sit for hours under the willows. The town council has restored the
towpaths, so that people can walk or cycle for miles beside the water. In the evenings, the cafés
near the bridge fill with neighbours who talk about the weather, the harvest and the football
results, much as their grandparents once talked about the price of grain and the height of the
river after the spring rains.

Scientists who study the region say that the rivers are cleaner now than at any time in the last
hundred years. Fish have returned to stretches of water where none were seen a generation ago, and
otters have been spotted near the old mill. Volunteers count the birds every winter, and their
records show more herons, kingfishers and ducks each year. The council hopes that careful planning
will allow the town to grow without losing the green spaces that make it a pleasant place to live.
"""


def chat_prompts(tokenizer, count: int = 48) -> list[list[int]]:
    """`count` prompts as token ids, through the model's chat template when it has one."""
    texts = [TEMPLATES[i % len(TEMPLATES)].format(TOPICS[i % len(TOPICS)]) for i in range(count)]
    if getattr(tokenizer, "chat_template", None):
        out = []
        for text in texts:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
        return out
    return [tokenizer.encode(text) for text in texts]


def agreement(base: list[list[int]], other: list[list[int]]) -> dict:
    """Answers identical, and the mean share of an answer agreeing up to its first difference."""
    same, shares = 0, []
    for x, y in zip(base, other, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same += x == y
        shares.append(n / max(len(x), len(y), 1))
    return {"exact": same, "prompts": len(base), "mean_prefix": sum(shares) / max(len(shares), 1)}


def generate(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy answers of `new_tokens` tokens (EOS ignored), every prompt in one batch."""
    from qmigrate.engine.rows import REFUSED, StepRow
    rows = [StepRow(i, p, 0, 0) for i, p in enumerate(prompts)]
    out: list[list[int]] = [[] for _ in prompts]
    for k in range(new_tokens):
        tokens = engine.step(rows)
        if REFUSED in tokens:
            raise RuntimeError("the KV pool refused a row: raise its size")
        for i, t in enumerate(tokens):
            out[i].append(t)
        rows = [StepRow(i, [t], len(prompts[i]) + k, k + 1) for i, t in enumerate(tokens)]
    for i in range(len(prompts)):
        engine.release(i)
    return out


@torch.inference_mode()
def perplexity(engine, ids: list[int], rows: int = ROWS) -> float:
    """exp(mean negative log-likelihood) of the text's tokens, teacher-forced through decode steps."""
    from qmigrate.engine.batch import StepBatch
    from qmigrate.engine.rows import StepRow
    length = len(ids) // rows
    seqs = [ids[r * length:(r + 1) * length] for r in range(rows)]
    first = 1 << 20   # sequence ids no other caller uses
    nll, count = 0.0, 0
    for p in range(length - 1):
        step = [StepRow(first + r, [s[p]], p, p) for r, s in enumerate(seqs)]
        if len(engine.place(step)) != rows:
            raise RuntimeError("the KV pool refused a row: raise its size")
        batch = StepBatch.build(engine.pool, [x.seq_id for x in step], [x.new_ids for x in step], [p] * rows)
        logits = engine.runner.forward(batch)[:rows].float()
        target = torch.tensor([s[p + 1] for s in seqs], device=logits.device)
        nll -= torch.log_softmax(logits, -1).gather(1, target[:, None]).sum().item()
        count += rows
        engine.pool.mark_written([x.seq_id for x in step], [p + 1] * rows)
    for r in range(rows):
        engine.release(first + r)
    return math.exp(nll / count)


def parse_variants(text: str) -> list[dict]:
    """'quantization=fp8;kv_cache_dtype=fp8,...' -> [{"quantization": "fp8"}, ...]."""
    try:
        return [dict(kv.split("=", 1) for kv in v.split(",")) for v in text.split(";") if v]
    except ValueError:
        raise ValueError(f"--variants takes KEY=VALUE[,KEY=VALUE] groups separated by ';', got {text!r}") from None


VARIANTS = ({}, {"quantization": "fp8"}, {"kv_cache_dtype": "fp8"}, {"quantization": "fp8", "kv_cache_dtype": "fp8"})


def run_quality(model_path: str, device: str, variants=VARIANTS, num_prompts: int = 48, new_tokens: int = NEW_TOKENS,
                runner: str = "auto", json_path: Path | None = None, text: str = TEXT) -> list[dict]:
    """Each variant of the engine settings against the first: greedy agreement and perplexity."""
    from transformers import AutoTokenizer
    from qmigrate.engine.engine import Engine
    from qmigrate.hub.loading import load_model
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = chat_prompts(tokenizer, num_prompts)
    text_ids = tokenizer.encode(text)
    results, base = [], None
    for settings in variants:
        model, _ = load_model(model_path, device, "auto")
        engine = Engine(model, runner=runner, max_num_seqs=max(64, num_prompts), enable_prefix_caching=False,
                        max_kv_tokens=1 << 16, own_model=True, **settings)
        del model
        answers = generate(engine, prompts, new_tokens)
        ppl = perplexity(engine, text_ids)
        name = ", ".join(f"{k} {v}" for k, v in settings.items()) or "baseline"
        print(f"{name}: {engine.describe()}", file=sys.stderr)
        row = {"variant": name, "settings": settings, "perplexity": ppl, "answers": answers}
        if base is None:
            base = row
        row["agreement"] = agreement(base["answers"], answers)
        row["perplexity_rise"] = ppl / base["perplexity"] - 1
        results.append(row)
        del engine
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"quality on {Path(model_path).name}: {num_prompts} chat prompts, {new_tokens} greedy tokens each "
          f"(EOS ignored), against {results[0]['variant']}; perplexity on a fixed text of {len(text_ids)} tokens")
    print(f"{'variant':>36} {'exact':>7} {'mean prefix':>11} {'perplexity':>10} {'rise':>7}")
    for r in results:
        a = r["agreement"]
        print(f"{r['variant']:>36} {a['exact']:>3}/{a['prompts']:<3} {a['mean_prefix']:11.3f} "
              f"{r['perplexity']:10.3f} {r['perplexity_rise'] * 100:6.2f}%")
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2))
    return results
