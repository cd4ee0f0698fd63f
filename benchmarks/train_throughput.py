"""Training throughput of the product path on one GPU, for randomly initialised 0.5B and 1.5B models of
Qwen2.5's shapes (no weights can be downloaded on the device): one PPO step of the paper's shape at small
batch, its seconds split into rollout (generation), evaluation and update.

    python benchmarks/train_throughput.py --sizes 0.5b 1.5b --context 32768 --out OUT

Per size:
  generation  ``TransformersBackend.generate`` (what ``cuda-agent train`` samples with): ``--new-tokens``
              tokens after a ``--prompt-tokens`` prompt, end-of-sequence disabled so every token counts; one
              sequence (as an agentic turn samples) and ``--gen-batch`` together (as single-turn replies do)
  evaluation  the real evaluator on the cuda_gelu example's solution (``Evaluator(prestart=True)``, warm):
              what one correct episode costs the evaluation side
  update      ``PPOTrainer.step`` over ``--batch`` sequences of ``--context`` tokens (prompt + a response of
              ``--new-tokens`` sampled tokens padded out with more sampled tokens), bf16 autocast on fp32
              master weights, gradient checkpointing, the lm_head scored in 4096-position chunks
A single-turn step of ``--batch`` episodes whose replies fill the context is then estimated
(``step_estimate``): their replies sampled together, their evaluations one after another (evaluations
time under one lock) and the update.
Writes OUT/train_throughput.json and OUT/train_throughput.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SIZES = {  # Qwen2.5's published shapes; tied embeddings, a 151,936-token vocabulary
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),  # a smoke run of this script (--device cpu)
}
VOCAB = 151_936


class Tokens:
    """What the sampler needs of a tokenizer (no tokenizer can be downloaded either)."""

    pad_token_id = 1  # not 0: the sampler reads `pad or eos`
    eos_token_id = None


def model(size: str, device: str):
    import transformers

    config = transformers.Qwen2Config(vocab_size=VOCAB, max_position_embeddings=131_072, tie_word_embeddings=True,
                                      attn_implementation="sdpa", **SIZES[size])
    torch.manual_seed(0)
    actor = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    actor.generation_config.eos_token_id = None
    return actor


def measure(size: str, args: argparse.Namespace, evaluate_s: float | None) -> dict:
    from cuda_agent.agent.tokens import TransformersBackend
    from cuda_agent.train.models import compute_precision, critic_from_actor
    from cuda_agent.train.ppo import PPOConfig, PPOTrainer
    from cuda_agent.train.rollout import Rollout, RolloutBatch

    device = args.device
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    actor = model(size, device)
    params = sum(p.numel() for p in actor.parameters())
    sampler = TransformersBackend(actor, Tokens(), temperature=1.0)
    prompt = torch.randint(0, VOCAB, (args.prompt_tokens,)).tolist()
    precision = "bf16" if cuda else "fp32"
    with compute_precision(precision, device):
        sampler.generate(prompt[:64], 8)  # warm-up
        sync()
        clock = time.perf_counter()
        out = sampler.generate(prompt, args.new_tokens)
        sync()
        generate_s = time.perf_counter() - clock
        generated = len(out.ids)
        print(f"[{size}] generation, one sequence (agentic turns): {generated} tokens in {generate_s:.1f} s "
              f"({generated / generate_s:.1f} tokens/s)", flush=True)
        sync()
        clock = time.perf_counter()
        outs = sampler.generate_batch([prompt] * args.gen_batch, args.new_tokens)
        sync()
        batch_s = time.perf_counter() - clock
        batch_tokens = sum(len(o.ids) for o in outs)
        print(f"[{size}] generation, {args.gen_batch} together (single-turn replies): {batch_tokens} tokens in "
              f"{batch_s:.1f} s ({batch_tokens / batch_s:.1f} tokens/s)", flush=True)

    critic = critic_from_actor(actor)
    if args.fsdp:
        # FSDP2's path on one GPU (a group of one): bf16 parameters in compute, fp32 reduction and masters.
        from cuda_agent.train.distributed import init_distributed, shard

        init_distributed(fsdp=True)
        shard(actor, precision)
        shard(critic, precision)
    trainer = PPOTrainer(actor, critic, PPOConfig(micro_batch=1), precision="fp32" if args.fsdp else precision,
                         logits_chunk=4096, gradient_checkpointing=True)
    response = args.context - args.prompt_tokens
    rollouts = []
    for row in range(args.batch):
        ids = torch.randint(0, VOCAB, (response,)).tolist()
        rollouts.append(Rollout(tuple(prompt), tuple(ids), (1,) * response, (-11.0,) * response, float(row % 2 * 2 - 1)))
    batch = RolloutBatch.collate(rollouts)
    trainer.step(RolloutBatch.collate(rollouts[:1]))  # warm-up (allocator, kernels)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    clock = time.perf_counter()
    trainer.step(batch)
    sync()
    update_s = time.perf_counter() - clock
    tokens = args.batch * args.context
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    print(f"[{size}] update: {args.batch} x {args.context} tokens in {update_s:.1f} s ({tokens / update_s:.0f} tokens/s), "
          f"peak {peak:.1f} GiB", flush=True)
    row = {"size": size, "fsdp": args.fsdp, "parameters": params, "prompt_tokens": args.prompt_tokens, "generated_tokens": generated,
           "generate_seconds": generate_s, "generate_tokens_per_s": generated / generate_s,
           "generate_batch": args.gen_batch, "generate_batch_seconds": batch_s,
           "generate_batch_tokens_per_s": batch_tokens / batch_s,
           "update_sequences": args.batch, "update_context": args.context, "update_seconds": update_s,
           "update_tokens_per_s": tokens / update_s, "update_peak_gib": peak,
           "evaluate_seconds": evaluate_s,
           "step_estimate": step_estimate(batch_s, args.new_tokens, args.context - args.prompt_tokens, args.batch,
                                          args.gen_batch, evaluate_s, update_s)}
    del trainer, actor, critic, sampler
    if cuda:
        torch.cuda.empty_cache()
    return row


def step_estimate(batch_s: float, new_tokens: int, reply_tokens: int, episodes: int, together: int,
                  evaluate_s: float | None, update_s: float) -> dict[str, float]:
    """A single-turn step of ``episodes`` whose replies fill the context (the update's sequences): sampled
    ``together`` at a time at the measured seconds per decoding step (extrapolated from ``new_tokens`` to
    ``reply_tokens``; attention over the longer context only adds to it), evaluated one after another,
    then the update."""
    calls = -(-episodes // together)
    return {"rollout_s": calls * batch_s / new_tokens * reply_tokens, "evaluate_s": episodes * (evaluate_s or 0.0),
            "update_s": update_s}


def evaluation_seconds(repeats: int) -> list[float]:
    """Warm evaluations of the cuda_gelu example's solution, after one that builds and caches: the first
    of them still starts the task's reference process (what an episode of a task new to the evaluator
    pays), the later ones find it running (the steady state)."""
    from cuda_agent.candidates import load_candidate
    from cuda_agent.evaluate import Evaluator
    from cuda_agent.tasks import load_task

    task = load_task(ROOT / "examples/cuda_gelu/model.py")
    candidate = load_candidate(ROOT / "examples/cuda_gelu/solution")
    evaluator = Evaluator("cuda", prestart=True)
    try:
        evaluator.evaluate(task, candidate)  # builds and caches the baselines
        times = []
        for _ in range(repeats):
            clock = time.perf_counter()
            result = evaluator.evaluate(task, candidate)
            times.append(time.perf_counter() - clock)
            print(f"evaluation: {times[-1]:.1f} s, reward {result.reward}", flush=True)
    finally:
        evaluator.close()
    return times


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    names = [r["size"] for r in rows]
    axes[0].bar([f"{n}\ngen x1" for n in names], [r["generate_tokens_per_s"] for r in rows], color="tab:blue")
    axes[0].bar([f"{n}\ngen x{r['generate_batch']}" for n, r in zip(names, rows)],
                [r["generate_batch_tokens_per_s"] for r in rows], color="tab:cyan")
    axes[0].bar([f"{n}\nupdate" for n in names], [r["update_tokens_per_s"] for r in rows], color="tab:orange")
    axes[0].tick_params(axis="x", labelsize=8)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("tokens / s")
    axes[0].set_title("throughput (one H200)", fontsize=10)
    width = 0.25
    for k, (key, label) in enumerate((("rollout_s", "rollout (sampling)"), ("evaluate_s", "evaluation"),
                                      ("update_s", "update"))):
        axes[1].bar([i + (k - 1) * width for i in range(len(rows))], [r["step_estimate"][key] for r in rows], width,
                    label=label)
    axes[1].set_xticks(range(len(rows)), names)
    axes[1].set_yscale("log")
    axes[1].set_ylabel("seconds (log)")
    axes[1].set_title(f"a single-turn step: {rows[0]['update_sequences']} replies filling {rows[0]['update_context']} "
                      "tokens", fontsize=10)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["0.5b", "1.5b"], choices=sorted(SIZES))
    parser.add_argument("--context", type=int, default=32_768)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="sequences of --context tokens per update")
    parser.add_argument("--gen-batch", type=int, default=16, help="prompts sampled together")
    parser.add_argument("--eval-repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--fsdp", action="store_true", help="update through FSDP2 (a group of one)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--replot", action="store_true", help="only redraw OUT/train_throughput.png from its JSON")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads((args.out / "train_throughput.json").read_text())["rows"], args.out / "train_throughput.png")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    import transformers

    evaluations = evaluation_seconds(args.eval_repeats) if args.eval_repeats else []
    rows = [measure(size, args, min(evaluations) if evaluations else None) | {"evaluate_seconds_all": evaluations}
            for size in args.sizes]
    report = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "transformers": transformers.__version__, "python": platform.python_version(), "rows": rows}
    (args.out / "train_throughput.json").write_text(json.dumps(report, indent=1))
    plot(rows, args.out / "train_throughput.png")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
