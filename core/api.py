"""The public surface for plugin authors: import from here, never from core's subpackages.

Everything a scheduler, cache allocator, quantizer, decoder, backend, attention backend or peer
needs is re-exported below; servelab's internal layout may move, this module's names stay.
In-repo plugins use nothing else of core's, exactly like the example package in
examples/servelab-plugin-example. docs/plugins.md is the guide.
"""

from core.config.schema import (
    AttentionConfig,
    BackendConfig,
    CacheConfig,
    DecoderConfig,
    ModelConfig,
    PeerConfig,
    QuantConfig,
    SchedulerConfig,
)
from core.engine.components import load_weights
from core.engine.defaults import BLOCK_SIZE
from core.engine.hardware import HardwareProfile, StepTime, StepTimeModel, weight_bytes_per_param
from core.engine.interfaces import (
    AttentionBackend,
    Backend,
    CacheAllocator,
    Decoder,
    Peer,
    Quantizer,
    Scheduler,
    SupportsCopyOnWrite,
    SupportsDeadlines,
    SupportsDescribe,
    SupportsFork,
    SupportsTruncate,
    has_capability,
)
from core.engine.records import RequestRecord, make_record
from core.engine.registry import hookimpl
from core.engine.scheduler_base import QueueScheduler, stop_status
from core.engine.step_cost import SchedulerContext, StepCostModel, StepShape
from core.engine.types import (
    CacheStats,
    DecoderOutput,
    KVCacheSpec,
    RequestTimings,
    SamplingParams,
    ScheduledSeq,
    SchedulerOutput,
    Sequence,
    SequenceStatus,
    StepStats,
)
from core.errors import ConfigError, ModelNotFoundError, RequestError, ServelabError
from core.model.calibration import calibration_prompts
from core.model.decode_plan import NativeDecode
from core.model.decode_plan import why_not as native_decode_why_not
from core.model.fuse import fuse_projections
from core.model.gguf import PERMUTED_ARCHS, gguf_to_hf_name, unpermute_qk
from core.model.llama import ForwardContext
from core.model.loader import DTYPES, load_model
from core.model.quantize import capture_linear_inputs, quantize_tied_embedding, swap_linears
from core.model.smooth import smooth_model
from core.runner.memory import kv_memory_budget
from core.runner.metadata import AttentionMetadata, ModelInput
from core.runner.model_runner import ModelRunner

__all__ = [
    # hooks
    "hookimpl",
    # configs (subclass one as your factory's `config_class` to add keys)
    "AttentionConfig", "BackendConfig", "CacheConfig", "DecoderConfig", "ModelConfig", "PeerConfig", "QuantConfig",
    "SchedulerConfig",
    # contracts and capabilities
    "AttentionBackend", "Backend", "CacheAllocator", "Decoder", "Peer", "Quantizer", "Scheduler",
    "SupportsCopyOnWrite", "SupportsDeadlines", "SupportsDescribe", "SupportsFork", "SupportsTruncate", "has_capability",
    # data
    "AttentionMetadata", "CacheStats", "DecoderOutput", "KVCacheSpec", "ModelInput", "RequestRecord",
    "RequestTimings", "SamplingParams", "ScheduledSeq", "SchedulerOutput", "Sequence", "SequenceStatus", "StepStats",
    # base classes and helpers
    "QueueScheduler", "stop_status", "SchedulerContext", "StepCostModel", "StepShape", "make_record", "DTYPES", "kv_memory_budget", "BLOCK_SIZE",
    "calibration_prompts", "capture_linear_inputs", "quantize_tied_embedding", "smooth_model", "swap_linears",
    "PERMUTED_ARCHS", "gguf_to_hf_name", "unpermute_qk",
    # a second model beside the engine's (speculative drafts): its forward, inputs and weights
    "ForwardContext", "ModelRunner", "fuse_projections", "load_model", "load_weights",
    # decode-only steps of a Llama model as one C++ call (the torch backend's CPU fast path)
    "NativeDecode", "native_decode_why_not",
    # the simulator's hardware profiles and step-time roofline
    "HardwareProfile", "StepTime", "StepTimeModel", "weight_bytes_per_param",
    # errors
    "ConfigError", "ModelNotFoundError", "RequestError", "ServelabError",
]
