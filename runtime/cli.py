"""`run-engine`: generate text from an engine folder through a `Session`.

Without `--stream` every prompt is submitted before any is read back, so the scheduler batches
them in flight; with `--stream` prompts run one after another and text prints as it arrives.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

import click

from kiln.engines.format import EngineFileError
from kiln.runtime.arguments import ArgumentError
from kiln.runtime.outputs import CompletionOutput, RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import POLICIES, POLICY_HELP
from kiln.runtime.session import Session


@dataclass(frozen=True)
class _Result:
    """One prompt's final output and what `--stats` needs from its run."""

    prompt: str
    output: RequestOutput | None  # None: the prompt was refused
    ttft: float | None  # seconds from submission to the first token; None if none came


class _StreamEcho:
    """Prints a streamed completion's new text as each output arrives (the Session's streamed
    text only ever grows: partial characters and possible stop-string starts are held back)."""

    def __init__(self) -> None:
        self.printed = 0

    def __call__(self, out: RequestOutput) -> None:
        text = out.outputs[0].text
        click.echo(text[self.printed:], nl=False)
        self.printed = len(text)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--engine", "engine_dir", required=True, type=click.Path(path_type=Path),
              help="Engine folder written by build-engine.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt text; repeat for several.")
@click.option("--prompt-file", type=click.File(encoding="utf-8"),
              help="File with one prompt per line (blank lines skipped); - reads stdin.")
@click.option("--chat", "chats", multiple=True,
              help="A user message, sent as a conversation through the engine's chat template; repeat for several "
                   "conversations (instead of --prompt).")
@click.option("--system", help="With --chat: the system message that starts each conversation.")
@click.option("--max-tokens", type=int, default=32, show_default=True, help="Most tokens per completion.")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="0 is greedy (always the most likely token); above 0 samples. The default here is 0, "
                   "so a quick try is reproducible; SamplingParams and the Triton backend default to 1.")
@click.option("--top-k", type=int, help="Sample from the K most likely tokens only [default: 0, off].")
@click.option("--top-p", type=float, help="Sample from the likeliest tokens that sum to P [default: 1, off].")
@click.option("--min-p", type=float, help="Drop tokens less likely than P x the most likely one [default: 0].")
@click.option("--repetition-penalty", type=float, help="Above 1 discourages tokens seen so far [default: 1].")
@click.option("--presence-penalty", type=float, help="Lowers tokens already generated, -2..2 [default: 0].")
@click.option("--frequency-penalty", type=float, help="Lowers tokens per time generated, -2..2 [default: 0].")
@click.option("--seed", type=int, help="Seed for sampling, so a run can be repeated.")
@click.option("--stop", multiple=True, help="Stop when the text contains this string (left out); repeatable.")
@click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True, help="Stop at this token id; repeatable.")
@click.option("--min-tokens", type=int, help="Generate at least this many tokens before any stop [default: 0].")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence tokens.")
@click.option("--n", type=int, help="Completions per prompt [default: 1].")
@click.option("--logprobs", type=int, metavar="N", help="Print each token's logprob and the N likeliest ones.")
@click.option("--kv-cache-fraction", type=float,
              help="Share of the memory left after weights and arena that the KV cache may take, capped at what "
                   "a full batch at max_seq_len can use [default: 0.9].")
@click.option("--max-kv-tokens", type=int, help="KV cache size in tokens, instead of --kv-cache-fraction.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where to run: auto takes the GPU when the engine was built for its arch (--target), "
                   "else the CPU.")
@click.option("--policy", type=click.Choice(POLICIES), default=POLICIES[0], show_default=True,
              help=POLICY_HELP)
@click.option("--no-overlap", is_flag=True,
              help="Run the plain engine loop: the host waits for each step's tokens before scheduling the next.")
@click.option("--no-prefix-caching", is_flag=True,
              help="Compute every prompt in full instead of reusing the KV blocks of prefixes seen before.")
@click.option("--stream", is_flag=True, help="Print text as it arrives, one prompt after another (n must be 1).")
@click.option("--stats", is_flag=True, help="Then print token counts, tokens/s, time to first token, KV use.")
@click.pass_context
def run_engine(ctx: click.Context, engine_dir: Path, prompts: tuple[str, ...], prompt_file: TextIO | None,
               chats: tuple[str, ...], system: str | None, kv_cache_fraction: float | None,
               max_kv_tokens: int | None, device: str, policy: str, no_overlap: bool, no_prefix_caching: bool,
               stream: bool, stats: bool, **sampling: Any) -> None:
    """Generate text from a Kiln engine.

    All prompts are submitted together and batched in flight. Sampling is greedy unless
    --temperature is above 0. A prompt the engine refuses (too long, empty) is reported on
    stderr and the others still run; the exit status is then 1.

    \b
    Examples:
      run-engine --engine engines/demo --prompt "The kiln was hot" --prompt "Once upon a time"
      run-engine --engine engines/demo --prompt-file prompts.txt --stats
      run-engine --engine engines/demo --prompt "Hello" --stream --max-tokens 64
      run-engine --engine engines/demo --prompt "Hello" --temperature 0.8 --top-p 0.95 --n 3 --seed 1
      run-engine --engine engines/demo --chat "What is a kiln?" --system "Answer in one sentence."
    """
    if chats and (prompts or prompt_file is not None):
        raise click.UsageError("give --chat or --prompt/--prompt-file, not both")
    if system is not None and not chats:
        raise click.UsageError("--system starts a --chat conversation: give --chat too")
    texts = list(chats) if chats else _read_prompts(prompts, prompt_file)
    params = _sampling_params(ctx, sampling)
    if stream and params.n != 1:
        raise click.UsageError("--stream prints one completion per prompt: drop --n or --stream")
    show_kiln_log()
    try:
        session = Session(engine_dir, device=device, kv_cache_fraction=kv_cache_fraction, max_kv_tokens=max_kv_tokens,
                          policy=policy, overlap=not no_overlap, prefix_caching=not no_prefix_caching)
    except ArgumentError as e:
        raise bad_flag(ctx, e) from None
    except (EngineFileError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    with session:
        # Checked here, not per prompt, because the Session's own message suggests token ids,
        # which this command does not take.
        if session.tokenizer is None:
            raise click.ClickException(f"{engine_dir} has no tokenizer: rebuild from a checkpoint that has one")
        if chats and session.chat_template is None:
            raise click.ClickException(f"{engine_dir} has no chat template (its checkpoint had none): use --prompt")
        submit = _chat_submitter(session, system) if chats else session.stream
        start = time.perf_counter()
        try:
            results = _run_streaming(submit, texts, params) if stream else _run_batch(session, submit, texts, params)
        except RuntimeError as e:  # the engine loop failed a step
            raise click.ClickException(str(e)) from None
        wall = time.perf_counter() - start
        if not stream:
            for result in results:
                _echo_result(result)
        done = [r for r in results if r.output is not None]
        if stats:
            _echo_stats(done, wall, session.stats, not no_prefix_caching)
    refused = len(results) - len(done)
    if refused:
        raise click.ClickException(f"{refused} of {len(results)} prompts were refused (see above); the others ran")


def show_kiln_log() -> None:
    """Show Kiln's INFO messages (the KV pool chosen at load) on stderr, once per process."""
    logger = logging.getLogger("kiln")
    if not any(isinstance(h, _EchoHandler) for h in logger.handlers):
        logger.addHandler(_EchoHandler())
    logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))


class _EchoHandler(logging.Handler):
    # Through click.echo, so the message goes to whatever stderr is now (a test runner's too).
    def emit(self, record: logging.LogRecord) -> None:
        click.echo(click.style(self.format(record), dim=True), err=True)


def bad_flag(ctx: click.Context, e: ArgumentError) -> click.BadParameter:
    """A Python-API argument's error, pointed at the flag that set it (when there is one)."""
    param = next((p for p in ctx.command.params if p.name == e.argument), None)
    return click.BadParameter(str(e), ctx=ctx, param=param)


def _read_prompts(prompts: tuple[str, ...], prompt_file: TextIO | None) -> list[str]:
    if bool(prompts) == (prompt_file is not None):
        raise click.UsageError("give --prompt (repeatable), --prompt-file or --chat: one of them")
    if prompts:
        return list(prompts)
    texts = [line.rstrip("\r\n") for line in prompt_file if line.strip()]
    if not texts:
        raise click.BadParameter(f"{prompt_file.name} holds no prompts", param_hint="'--prompt-file'")
    return texts


def _sampling_params(ctx: click.Context, sampling: dict[str, Any]) -> SamplingParams:
    try:
        # Unset flags are left out so SamplingParams' own defaults apply.
        return SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    except ArgumentError as e:
        raise bad_flag(ctx, e) from None


Submit = Callable[[str, SamplingParams], Iterator[RequestOutput]]


def _chat_submitter(session: Session, system: str | None) -> Submit:
    """Streams a user message as a conversation (after the system message, if any)."""
    def submit(message: str, params: SamplingParams) -> Iterator[RequestOutput]:
        conversation = ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": message}]
        return session.stream(sampling_params=params,
                              prompt_token_ids=session.apply_chat_template(conversation, tokenize=True))
    return submit


def _submit(submit: Submit, index: int, prompt: str, params: SamplingParams) -> Iterator[RequestOutput] | None:
    """Start one request (stream() submits at once, before its first output is read); a refused
    prompt is reported on stderr and gives None, so the others still run."""
    try:
        return submit(prompt, params)
    except ValueError as e:
        shown = prompt if len(prompt) <= 40 else prompt[:37] + "..."
        click.echo(click.style(f"Error: prompt {index + 1} ({shown!r}) was refused: {e}", fg="red"), err=True)
        return None


def _consume(prompt: str, outputs: Iterator[RequestOutput] | None, submitted: float,
             on_output: Callable[[RequestOutput], None] | None = None) -> _Result:
    ttft, last = None, None
    for out in outputs or ():
        if ttft is None and any(c.token_ids for c in out.outputs):
            ttft = time.perf_counter() - submitted
        if on_output is not None:
            on_output(out)
        last = out
    return _Result(prompt, last, ttft)


def _run_batch(session: Session, submit: Submit, prompts: list[str], params: SamplingParams) -> list[_Result]:
    submitted = time.perf_counter()
    streams = [_submit(submit, i, p, params) for i, p in enumerate(prompts)]
    # One reader per request, so each first token is timed when it arrives rather than when
    # the requests before it finish.
    pool = ThreadPoolExecutor(max_workers=len(streams), thread_name_prefix="run-engine-reader")
    try:
        return list(pool.map(lambda p, s: _consume(p, s, submitted), prompts, streams))
    except BaseException:
        session.close()  # on Ctrl-C too: cancelling every request lets the readers return now
        raise
    finally:
        pool.shutdown()


def _run_streaming(submit: Submit, prompts: list[str], params: SamplingParams) -> list[_Result]:
    results = []
    for i, prompt in enumerate(prompts):
        submitted = time.perf_counter()
        outputs = _submit(submit, i, prompt, params)
        if outputs is None:
            results.append(_Result(prompt, None, None))
            continue
        click.echo(click.style(prompt, bold=True), nl=False)
        result = _consume(prompt, outputs, submitted, _StreamEcho())
        completion = result.output.outputs[0]
        click.echo(_finish_note(completion))
        _echo_logprobs(completion)
        results.append(result)
    return results


def _finish_note(completion: CompletionOutput) -> str:
    note = completion.finish_reason
    if completion.logprobs:
        note += f", logprob {sum(lp['logprob'] for lp in completion.logprobs):.2f}"
    return click.style(f"  [{note}]", dim=True)


def _echo_logprobs(completion: CompletionOutput) -> None:
    for lp in completion.logprobs or ():
        top = "  ".join(f"{token}:{logprob:.3f}" for token, logprob in lp["top"])
        click.echo(click.style(f"    token {lp['token']}: {lp['logprob']:.3f}" + (f"  top {top}" if top else ""),
                               dim=True))


def _echo_result(result: _Result) -> None:
    if result.output is None:  # refused: already reported when it was submitted
        return
    completions = result.output.outputs
    if len(completions) == 1:
        click.echo(click.style(result.prompt, bold=True) + completions[0].text + _finish_note(completions[0]))
        _echo_logprobs(completions[0])
        return
    click.echo(click.style(result.prompt, bold=True))
    for c in completions:
        click.echo(f"  [n={c.index}] {c.text}" + _finish_note(c))
        _echo_logprobs(c)


def _hit_rate(session_stats: dict, prefix_caching: bool) -> str:
    queries, hits = session_stats["prefix_cache_queries"], session_stats["prefix_cache_hits"]
    if not prefix_caching:
        return "off (--no-prefix-caching)"
    return f"{hits} of {queries} prompt tokens found cached ({100 * hits / max(queries, 1):.1f}%)"


def _echo_stats(results: list[_Result], wall: float, session_stats: dict, prefix_caching: bool) -> None:
    generated = sum(len(c.token_ids) for r in results for c in r.output.outputs)
    ttfts = [r.ttft for r in results if r.ttft is not None]
    rows = [
        ("requests", f"{len(results)}"),
        ("prompt tokens", f"{sum(len(r.output.prompt_token_ids) for r in results)}"),
        ("generated tokens", f"{generated}"),
        ("wall time", f"{wall:.2f} s"),
        ("throughput", f"{generated / wall:.1f} generated tokens/s"),
        ("time to first token", f"{1000 * sum(ttfts) / len(ttfts):.1f} ms mean" if ttfts else "none"),
        ("KV blocks used", f"{session_stats['kv_blocks_peak']} peak / {session_stats['kv_blocks_total']} total"),
        ("preemptions", f"{session_stats['preemptions']}"),
        ("prefix cache", _hit_rate(session_stats, prefix_caching)),
        ("engine loaded", f"{session_stats['loaded_s']:.2f} s after process start"),
        ("first token", f"{session_stats['first_token_s']:.2f} s after process start"
         if session_stats["first_token_s"] is not None else "none"),
    ]
    for name, value in rows:
        click.echo(click.style(f"{name:<21}", dim=True) + value, err=True)
