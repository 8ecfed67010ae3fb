"""The serving engine without Ray: precision, KV-cache decoding, sampling, text streaming, continuous batching."""

import asyncio
import random
from dataclasses import replace

import pytest
import torch

from serve.decoder import Decoder, padded_prompts, span_bucket
from serve.engine import GENERATION_FAILED, Chunk, ContinuousBatcher, Engine, GenerationParams, Sequence, joined
from serve.precision import (
    EXACT_FLOAT32_K,
    Int8Linear,
    apply_precision,
    int8_matmul_kernel,
    int8_matmul_on_float_units,
    int8_matmul_on_integer_units,
)
from serve.sampling import apply_penalties, make_generator, token_logprob
from serve.sampling import next_token as next_token_tensor
from serve.textstream import TextStream
from tests.conftest import MEMORIZED_TEXT
from train.export import load_exported
from train.model import GPT
from train.model_config import ModelConfig
from train.tokenizer import ByteTokenizer

pytestmark = pytest.mark.unit

TOKENIZER = ByteTokenizer()
CPU = torch.device("cpu")
PROMPTS = ["Grüße", "3 € für", "und 🚀. Grüße aus Köln", "K", "für ☕", "aus Köln: 3", "Gr", "🚀"]


def encode(text: str) -> list[int]:
    return [int(t) for t in TOKENIZER.encode(text)]


def make_engine(
    export: str, precision: str, max_batch: int = 8, device: str = "cpu", compile: bool | str = "auto"
) -> Engine:
    exported = load_exported(export)
    return Engine(Decoder(exported.model, max_batch, precision, device, compile=compile), exported.tokenizer)


async def generated(batcher: ContinuousBatcher, prompt: str, params: GenerationParams, **options) -> list[Chunk]:
    """Every chunk of one request through ``batcher``."""
    return [chunk async for chunk in batcher.generate(Sequence(encode(prompt), params), **options)]


def text_of(chunks: list[Chunk]) -> str:
    return "".join(chunk.text for chunk in chunks)


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_int8_linear_is_close_to_float_and_independent_of_the_batch():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    quantized = Int8Linear(linear)
    x = torch.randn(16, 64)
    relative = (quantized(x) - linear(x)).norm() / linear(x).norm()
    assert relative < 0.02
    # Each row gets its own activation scale: a row's output is the same alone or among others.
    assert torch.equal(quantized(x[3:4]), quantized(x)[3:4])


@pytest.mark.parametrize("k", [64, EXACT_FLOAT32_K, 3 * EXACT_FLOAT32_K + 7])
@pytest.mark.parametrize("batch", [1, 32])
def test_both_int8_matmul_kernels_are_exact_so_the_faster_one_changes_no_token(k, batch):
    torch.manual_seed(0)
    a = torch.randint(-127, 128, (batch, k), dtype=torch.int8)
    b = torch.randint(-127, 128, (k, 24), dtype=torch.int8)
    a[0], b[:, 0] = 127, 127  # the largest sum there is, where float32 would first round
    exact = (a.long() @ b.long()).float()  # int64 sums, rounded once
    assert torch.equal(int8_matmul_on_float_units(a, b), exact)
    assert torch.equal(int8_matmul_on_integer_units(a, b), exact)
    assert int8_matmul_kernel() in (int8_matmul_on_float_units, int8_matmul_on_integer_units)


def test_fp8_is_refused_on_cpu():
    with pytest.raises(ValueError, match="fp8"):
        apply_precision(torch.nn.Linear(2, 2), "fp8", torch.device("cpu"))


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_kv_cache_decoding_matches_the_full_forward(precision):
    torch.manual_seed(0)
    model = GPT(ModelConfig(seq_len=32, n_layer=2, n_head=2, d_model=32)).eval()
    reference = GPT(model.cfg).eval()
    reference.load_state_dict(model.state_dict())
    if precision == "int8":
        apply_precision(reference, "int8", torch.device("cpu"))
    decoder = Decoder(model, max_batch=2, precision=precision)
    prompts = [[5, 6, 7, 8, 9], [200, 201]]
    tolerance = 1e-5 if precision == "fp32" else 0.05  # int8 also quantizes the head the reference keeps in float
    # Both prompts in one pass: the shorter one is padded, and its padding must change nothing.
    together = decoder.prefill([0, 1], [p[:-1] for p in prompts], [True, False])
    assert torch.allclose(together[0], reference(torch.tensor([prompts[0][:-1]]))[0], atol=tolerance)
    assert torch.allclose(together[1], reference(torch.tensor([prompts[1][:-1]]))[0, -1:], atol=tolerance)
    alone = decoder.prefill([1], [prompts[1][:-1]], [False])[0]
    if precision == "int8":  # its rows are computed independently: the same bits alone or together
        assert torch.equal(alone, together[1])
    else:  # a float matmul's rounding may follow the batch's shape
        assert torch.allclose(alone, together[1], atol=1e-6)
    tokens, positions = [p[-1] for p in prompts], [len(p) - 1 for p in prompts]
    logits = decoder.decode(tokens, positions)
    for row, prompt in zip(logits, prompts, strict=True):
        assert torch.allclose(row, reference(torch.tensor([prompt]))[0, -1], atol=tolerance)
    # The step read the cache up to 16 positions; reading all 32 (masked) gives the same bits.
    assert span_bucket(max(positions) + 1, model.cfg.seq_len) == 16
    whole = decoder.decode_span(torch.tensor(tokens), torch.tensor(positions), model.cfg.seq_len)
    assert torch.equal(whole, logits)


def test_padding_rows_of_a_captured_decode_shape_change_no_live_sequence():
    """What the CUDA graphs rely on, checked on the CPU: a decode step padded to a larger batch (extra rows
    write position 0 of free slots) gives the live rows the same bits, and a prompt later prefilled into
    a padded slot decodes as in a fresh cache."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(seq_len=32, n_layer=2, n_head=2, d_model=32)).eval()
    prompts = [[5, 6, 7, 8], [200, 201], [9, 10, 11]]
    padded, plain = (Decoder(model, max_batch=4, precision="int8") for _ in range(2))
    for decoder in (padded, plain):
        decoder.prefill([0, 1, 2], prompts, [False] * 3)
    tokens, positions = [1, 2, 3], [len(p) for p in prompts]
    live = plain.decode_span(torch.tensor(tokens), torch.tensor(positions), 16)
    with_padding = padded.decode_span(torch.tensor([*tokens, 0]), torch.tensor([*positions, 0]), 16)
    assert torch.equal(with_padding[:3], live)
    late = [42, 43, 44, 45, 46]
    for decoder in (padded, plain):
        decoder.prefill([3], [late], [False])
    fresh = Decoder(model, max_batch=1, precision="int8")
    fresh.prefill([0], [late], [False])
    expected = fresh.decode([7], [len(late)])
    assert torch.equal(padded.decode([*tokens, 7], [p + 1 for p in positions] + [len(late)])[3:], expected)


def test_a_prefill_padded_to_its_graph_shape_gives_each_prompt_its_own_logits_and_cache():
    """What the prefill's CUDA graphs rely on, checked on the CPU: three prompts padded to a batch of 4 (the
    extra row repeats the first prompt, into its slot) and to a width of 16 give each prompt the logits and
    the cache of an unpadded prefill, and the decoding after it is the same."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(seq_len=32, n_layer=2, n_head=2, d_model=32)).eval()
    prompts = [[5, 6, 7, 8], [200, 201], [9, 10, 11, 12, 13]]
    padded, plain = (Decoder(model, max_batch=4, precision="int8") for _ in range(2))
    expected = torch.cat(plain.prefill([2, 0, 1], prompts, [False] * 3))
    inputs = padded_prompts([2, 0, 1], prompts, batch=4, width=16)
    assert inputs[0].shape == (4, 16) and inputs[1].tolist() == [2, 0, 1, 2]
    with torch.inference_mode():
        _, logits = padded.prefill_pass(*inputs)
    assert torch.equal(logits[:3], expected)
    for slot, prompt in zip([2, 0, 1], prompts, strict=True):
        for cache in ("keys", "values"):
            assert torch.equal(
                getattr(padded, cache)[:, slot, :, : len(prompt)], getattr(plain, cache)[:, slot, :, : len(prompt)]
            )
    tokens, positions = [1, 2, 3], [len(prompts[1]), len(prompts[2]), len(prompts[0])]
    assert torch.equal(padded.decode(tokens, positions), plain.decode(tokens, positions))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_prefills_and_decode_steps_give_the_eager_logits_on_a_gpu():
    """Prefills of 3, then 1 prompt and decode steps replayed as CUDA graphs ÷ the same run eagerly, fp32."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(seq_len=64, n_layer=2, n_head=2, d_model=32)).eval()
    graphed, eager = (Decoder(model, 4, "fp32", "cuda", cuda_graphs=g, compile=False) for g in (True, False))
    assert graphed.prefill_graphs is not None and eager.prefill_graphs is None
    prompts = [[5, 6, 7, 8], [200, 201], [9, 10, 11]]
    for slots, batch in (([0, 1, 2], prompts), ([3], [[42, 43, 44, 45, 46]])):
        got, expected = (torch.cat(d.prefill(slots, batch, [False] * len(batch))) for d in (graphed, eager))
        assert torch.allclose(got, expected, atol=1e-4)
    tokens, positions = [1, 2, 3, 4], [4, 2, 3, 5]
    for _ in range(20):  # spans 16 and 32
        got, expected = graphed.decode(tokens, positions), eager.decode(tokens, positions)
        assert torch.allclose(got, expected, atol=1e-4)
        tokens, positions = expected.argmax(-1).tolist(), [p + 1 for p in positions]
    # Neither fell back to running eagerly (as each does where a capture fails).
    assert graphed.prefill_graphs is not None and graphed.decode_graphs is not None


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-5), ("int8", 1e-3)])
def test_the_compiled_decode_step_gives_the_uncompiled_logits_and_cache(precision, tolerance):
    """The step ``compile`` serves (on a GPU by default), checked on the CPU: batches of 3 and then 1 (the
    compiler specializes size 1), every span up to the whole context, each step's keys and values written into
    the cache. One layer is compiled, when a decoder is built (a replica's start), and serves every layer: a
    deeper model of the same width compiles nothing more, neither when built nor while it serves."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    shape = {"seq_len": 64, "n_head": 2, "d_model": 32}
    compilations = counters["frames"]["ok"]
    Decoder(GPT(ModelConfig(n_layer=1, **shape)).eval(), 4, precision, compile=True)
    assert counters["frames"]["ok"] > compilations
    compilations = counters["frames"]["ok"]
    model = GPT(ModelConfig(n_layer=3, **shape)).eval()
    compiled, plain = Decoder(model, 4, precision, compile=True), Decoder(model, 4, precision, compile=False)
    assert compiled.decode_layer is not plain.decode_layer
    prompts = [[5, 6, 7, 8], [200, 201], [9, 10, 11]]
    for decoder in (compiled, plain):
        decoder.prefill([0, 1, 2], prompts, [False] * 3)
    tokens, positions = [1, 2, 3], [len(p) for p in prompts]
    while max(positions) < model.cfg.seq_len:
        batch = 3 if max(positions) < 32 else 1
        expected = plain.decode(tokens[:batch], positions[:batch])
        assert torch.allclose(compiled.decode(tokens[:batch], positions[:batch]), expected, atol=tolerance)
        tokens, positions = expected.argmax(-1).tolist(), [p + 1 for p in positions[:batch]]
    assert torch.allclose(compiled.keys, plain.keys, atol=tolerance)
    assert torch.allclose(compiled.values, plain.values, atol=tolerance)
    assert counters["frames"]["ok"] == compilations


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    return int(next_token_tensor(logits, temperature, top_p, generator))


def test_sampling_greedy_top_p_and_seed():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert next_token(logits, 0.0, 1.0, None) == 1
    # A tiny nucleus holds only the most likely token.
    assert {next_token(logits, 1.0, 0.01, make_generator(s, CPU)) for s in range(20)} == {1}
    draws = [[next_token(logits, 1.0, 1.0, make_generator(7, CPU)) for _ in range(5)] for _ in range(2)]
    assert draws[0] == draws[1]
    assert len({next_token(logits, 1.0, 1.0, make_generator(s, CPU)) for s in range(50)}) > 1


def test_extreme_sampling_values_are_safe_and_penalties_follow_openai():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    # Values that once made an invalid distribution (inf/NaN, or an empty nucleus) for the whole batch.
    assert next_token(logits, 1e-39, 1.0, make_generator(0, CPU)) == 1
    assert next_token(logits, 1.0, 5e-324, make_generator(0, CPU)) == 1
    assert next_token(logits, 2.0, 5e-324, make_generator(0, CPU)) == 1
    counts = torch.tensor([0.0, 2.0, 0.0, 0.0])
    assert torch.equal(apply_penalties(logits, counts, 0.5, 0.25), torch.tensor([0.0, 2.0, 1.0, 2.9]))
    assert next_token(apply_penalties(logits, counts, 0.5, 0.25), 0.0, 1.0, None) == 3
    top = token_logprob(logits, 2, top=2)
    assert top.logprob == pytest.approx(float(torch.log_softmax(logits, 0)[2]))
    assert [token for token, _ in top.top] == [1, 3]


def test_a_sequence_whose_sampling_fails_fails_alone(memorized_export):
    engine = make_engine(memorized_export, "fp32")
    greedy = GenerationParams(max_tokens=12, temperature=0.0)
    broken = Sequence(encode("Köln"), GenerationParams(max_tokens=12, temperature=1.0, top_p=float("nan")))
    broken.generator = "not a generator"  # sampling with it raises inside the step
    good = [Sequence(encode(p), greedy) for p in ("Grüße", "3 € für")]
    texts = engine.run_batch([good[0], broken, good[1]])
    assert broken.finish_reason == "error" and texts[1] == GENERATION_FAILED
    alone = [
        make_engine(memorized_export, "fp32").run_batch([Sequence(encode(p), greedy)])[0] for p in ("Grüße", "3 € für")
    ]
    assert [texts[0], texts[2]] == alone


def test_text_stream_joins_to_the_full_text_and_stops_across_chunks():
    data = "Köln 🚀 ende\n\nrest".encode()
    stream = TextStream(stop=["\n\n"])
    chunks = [stream.push(data[i : i + 1]) for i in range(len(data))]
    assert "".join(chunks) + stream.finish() == "Köln 🚀 ende"
    assert stream.stopped
    # Text that might begin a stop sequence is held back until it cannot.
    stream = TextStream(stop=["xyz"])
    assert stream.push(b"abx") == "ab"
    assert stream.push(b"y") == ""
    assert stream.push(b"!") == "xy!"
    # A character cut off by the end of generation becomes one replacement character.
    stream = TextStream(stop=[])
    assert stream.push("€".encode()[:2]) == ""
    assert stream.finish() == "\ufffd"


def test_memorized_text_is_recited_with_its_multibyte_characters(memorized_export):
    engine = make_engine(memorized_export, "int8")
    (text,) = engine.run_batch([Sequence(encode("Grüße aus"), GenerationParams(max_tokens=40, temperature=0.0))])
    assert text == (MEMORIZED_TEXT * 2)[len("Grüße aus") :][: len(text)]
    assert "€" in text and "☕" in text


def test_stop_sequences_and_max_tokens(memorized_export):
    engine = make_engine(memorized_export, "int8")
    stopped = Sequence(encode("Grüße"), GenerationParams(max_tokens=60, temperature=0.0, stop=["€"]))
    limited = Sequence(encode("Grüße"), GenerationParams(max_tokens=5, temperature=0.0))
    assert engine.run_batch([stopped, limited]) == [" aus Köln: 3 ", " aus "]
    assert (stopped.finish_reason, limited.finish_reason) == ("stop", "length")


def test_a_prompt_scored_with_no_tokens_to_generate_gets_the_logprobs_a_generation_would(memorized_export):
    engine = make_engine(memorized_export, "int8")
    scored, generating = (
        Sequence(encode("Grüße aus"), GenerationParams(max_tokens=n, temperature=0.0, logprobs=1, prompt_logprobs=True))
        for n in (0, 5)
    )
    assert engine.run_batch([scored, generating]) == ["", " Köl"]
    assert scored.finish_reason == "length" and scored.generated == 0 and not engine.live
    assert len(scored.prompt_logprobs) == len(encode("Grüße aus")) - 1
    assert scored.prompt_logprobs == generating.prompt_logprobs


@pytest.mark.parametrize(
    "device, precision, compile",
    [
        ("cpu", "int8", "auto"),
        ("cpu", "fp32", "auto"),
        ("cpu", "int8", True),
        # On a GPU, compiled (the default there) and replayed as CUDA graphs.
        *(pytest.param("cuda", precision, "auto", marks=ON_GPU) for precision in ("bf16", "fp32", "int8", "fp8")),
    ],
)
def test_continuous_batching_gives_each_request_its_text_alone(memorized_export, device, precision, compile):
    """Greedy and seeded sampled requests arriving at random times, joining and leaving a shared batch."""
    params = [GenerationParams(max_tokens=10 + 7 * i, temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(8)]
    # One engine of as many slots for every request alone: on a GPU its compiled step and graphs are reused.
    single = make_engine(memorized_export, precision, 4, device, compile)
    alone = [single.run_batch([Sequence(encode(p), q)])[0] for p, q in zip(PROMPTS, params, strict=True)]
    assert PROMPTS[1] + alone[1] in MEMORIZED_TEXT * 3  # greedy recites: the comparison below is not of noise
    engine = make_engine(memorized_export, precision, 4, device, compile)  # fewer slots than requests
    batch_sizes = []
    batcher = ContinuousBatcher(engine, on_step=lambda size, queued: batch_sizes.append(size))

    async def one(prompt: str, p: GenerationParams, delay: float) -> str:
        await asyncio.sleep(delay)
        return text_of(await generated(batcher, prompt, p))

    async def all_at_once() -> list[str]:
        rng = random.Random(0)
        return await asyncio.gather(*(one(x, p, rng.uniform(0, 0.05)) for x, p in zip(PROMPTS, params, strict=True)))

    assert asyncio.run(all_at_once()) == alone
    assert max(batch_sizes) == 4


@pytest.mark.parametrize("step_in_thread", [True, False], ids=["step in a thread", "step on the loop"])
def test_a_request_that_arrives_while_another_decodes_joins_its_batch(memorized_export, step_in_thread):
    """Whether a step runs in a thread (a replica) or on the event loop (the engine process), requests get in
    between steps: one that arrives while another decodes joins the batch and ends first."""
    batch_sizes = []
    engine = make_engine(memorized_export, "int8", max_batch=2)
    batcher = ContinuousBatcher(engine, lambda size, queued: batch_sizes.append(size), step_in_thread)
    ended = []

    async def long(decoding: asyncio.Event) -> None:
        async for _ in batcher.generate(Sequence(encode("K"), GenerationParams(max_tokens=80, temperature=0.0))):
            decoding.set()
        ended.append("long")

    async def short(decoding: asyncio.Event) -> None:
        await decoding.wait()
        await generated(batcher, "Grüße", GenerationParams(max_tokens=5, temperature=0.0))
        ended.append("short")

    async def both() -> None:
        decoding = asyncio.Event()
        async with asyncio.timeout(60):
            await asyncio.gather(long(decoding), short(decoding))

    asyncio.run(both())
    assert ended == ["short", "long"] and max(batch_sizes) == 2


def test_the_decode_loop_accounts_for_its_steps_prefills_and_turnaround(memorized_export):
    """Six requests for five tokens each, four slots: the first four are prefilled together and take five
    steps, the last two are prefilled together when those leave and take five more."""
    engine = make_engine(memorized_export, "int8", max_batch=4)
    batcher = ContinuousBatcher(engine)
    params = GenerationParams(max_tokens=5, temperature=0.0)

    async def requests() -> list[list[Chunk]]:
        return await asyncio.gather(*(generated(batcher, prompt, params) for prompt in PROMPTS[:6]))

    assert all(text_of(chunks) for chunks in asyncio.run(requests()))
    times = engine.times
    assert (times.steps, times.prefills, times.prompts_prefilled) == (10, 2, 6)
    assert 0 < times.prefill_s < times.step_s < times.loop_s


def test_a_sequence_that_leaves_the_batch_costs_at_most_one_cache_move(memorized_export):
    """Live sequences keep slots 0..B-1; the slot a finished one frees takes the cache of the last, rather
    than every sequence above it moving down one (on a GPU each move copies a slot's whole cache)."""
    engine = make_engine(memorized_export, "int8", max_batch=4)
    moves = []
    move = engine.decoder.move
    engine.decoder.move = lambda source, target: (moves.append((source, target)), move(source, target))
    prompts = ["Grüße", "Köln", "3 € ", "für "]
    params = [GenerationParams(max_tokens=n, temperature=0.0) for n in (3, 6, 9, 12)]  # slot 0 leaves first
    texts = engine.run_batch([Sequence(encode(p), q) for p, q in zip(prompts, params, strict=True)])
    alone = [
        make_engine(memorized_export, "int8", max_batch=1).run_batch([Sequence(encode(p), q)])[0]
        for p, q in zip(prompts, params, strict=True)
    ]
    assert texts == alone
    assert moves == [(3, 0), (2, 1)]  # the third to leave was then the last: no move


def test_the_sequences_left_after_a_cancelled_one_decode_from_their_own_slots(memorized_export):
    """A cancelled sequence leaves before the step decodes: the others' rows follow their new slots
    (each token's logprob, which a wrong slot's cache changes even where the memorized text does not)."""
    prompts = ["Grüße", "Köln", "3 € "]
    params = GenerationParams(max_tokens=12, temperature=0.0, logprobs=0)
    engine = make_engine(memorized_export, "int8", max_batch=3)
    gone, *kept = (Sequence(encode(p), params) for p in prompts)
    engine.step([gone, *kept])
    gone.cancelled = True  # its caller went away: its slot (0) takes the last sequence's cache
    while engine.live:
        engine.step([])
    alone = [Sequence(encode(p), params) for p in prompts[1:]]
    for seq in alone:
        make_engine(memorized_export, "int8", max_batch=1).run_batch([seq])
    logprobs = [[lp.logprob for chunk in seq.chunks for lp in chunk.logprobs] for seq in (*kept, *alone)]
    assert logprobs[:2] == logprobs[2:] and len(logprobs[0]) == 12


def test_a_caller_that_wants_the_whole_text_is_woken_once_with_all_of_it(memorized_export):
    """What the non-streaming endpoints ask for: one chunk when the sequence ends, so the event loop
    handles such a caller once per request rather than once per token; a streaming caller beside it
    still gets each token as it comes."""
    batcher = ContinuousBatcher(make_engine(memorized_export, "int8", max_batch=2))
    greedy = GenerationParams(max_tokens=22, temperature=0.0)

    async def consume(whole: bool) -> tuple[list[Chunk], list[bool]]:
        seq, chunks, ended = Sequence(encode("Grüße"), greedy), [], []
        async for chunk in batcher.generate(seq, whole=whole):
            chunks.append(chunk)
            ended.append(seq.finish_reason is not None)
        return chunks, ended

    async def both() -> list[tuple[list[Chunk], list[bool]]]:
        return await asyncio.gather(consume(whole=True), consume(whole=False))

    (whole, whole_ended), (streamed, streamed_ended) = asyncio.run(both())
    assert whole_ended == [True] and whole == [joined(streamed)]
    assert whole[0] == Chunk(" aus Köln: 3 € für", "length", 22)
    assert len(streamed) == 22 and streamed_ended[0] is False


def test_a_request_past_its_timeout_ends_and_frees_its_slot(memorized_export):
    batcher = ContinuousBatcher(make_engine(memorized_export, "int8", max_batch=1))
    greedy = GenerationParams(max_tokens=80, temperature=0.0)

    async def run() -> tuple[list, str]:
        late = await generated(batcher, "K", greedy, timeout_s=0.001)
        after = text_of(await generated(batcher, "Grüße", replace(greedy, max_tokens=5)))
        return late, after

    late, after = asyncio.run(run())
    assert late[-1].finish_reason == "timeout" and "longer than 0.001 s" in late[-1].text
    assert after == " aus " and batcher.loop_failed is None


def test_a_failed_decode_step_fails_the_requests_in_flight_and_the_loop_serves_on(memorized_export):
    """A step whose forward fails (on a GPU, say, out of memory) ends the requests in that batch with an
    error; the decode loop goes on and the next request is served."""
    engine = make_engine(memorized_export, "int8", max_batch=2)
    batcher = ContinuousBatcher(engine)
    decode, calls = engine.decoder.decode, []

    def third_step_fails(tokens: list[int], positions: list[int]) -> torch.Tensor:
        calls.append(len(tokens))
        if len(calls) == 3:
            raise RuntimeError("CUDA out of memory")
        return decode(tokens, positions)

    engine.decoder.decode = third_step_fails
    greedy = GenerationParams(max_tokens=8, temperature=0.0)

    async def run() -> tuple[list[list[Chunk]], list[Chunk]]:
        async with asyncio.timeout(60):  # a loop that died with the step would leave its callers waiting
            failed = await asyncio.gather(generated(batcher, "Grüße", greedy), generated(batcher, "Köln", greedy))
            return failed, await generated(batcher, "Grüße", replace(greedy, max_tokens=5))

    failed, after = asyncio.run(run())
    assert calls[:3] == [2, 2, 2]  # both requests were in the step that failed
    for request in failed:  # each had its prompt's token and two decoded ones, then the failure
        assert len(request) == 4 and request[-1] == Chunk(GENERATION_FAILED, "error", 0)
    assert text_of(after) == " aus " and batcher.loop_failed is None
