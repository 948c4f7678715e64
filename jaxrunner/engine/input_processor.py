"""Input processing: a prompt and its sampling parameters become the scheduler's ``Request``s.

It tokenizes text prompts, reads their images (expanding each image's placeholder
to its tokens, ``jaxrunner.multimodal``), refuses what could never run (a ``ValueError``
whose message the caller returns as the request's error output; a LoRA
adapter that cannot be read or does not fit the model among them), resolves
what the runner needs as token ids (stop ids with EOS, bad words), fans
``n > 1`` out into one request per sequence and registers their grammars.
vLLM's ``v1/engine/processor.py`` does this job there.
"""

from __future__ import annotations

import dataclasses
import time

from jaxrunner.engine.lora_requests import LoRARequestChecker
from jaxrunner.engine.prompts import ParsedPrompt
from jaxrunner.engine.request import Request
from jaxrunner.engine.scheduler import Scheduler
from jaxrunner.engine.structured_outputs import StructuredOutputManager
from jaxrunner.interfaces import SamplingParams
from jaxrunner.lora.request import LoRARequest
from jaxrunner.multimodal.inputs import MultiModalFeatureSpec
from jaxrunner.multimodal.processing import MultiModalProcessor
from jaxrunner.runner.model_runner import ModelRunner


@dataclasses.dataclass
class PreparedPrompt:
    """A prompt checked and made into its requests (one per sequence), not queued yet."""

    request_id: str
    prompt: str | None
    token_ids: list[int]
    requests: list[Request]


class InputProcessor:
    """Checks and prepares requests against one engine's runner, scheduler and tokenizer."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer,
        structured_outputs: StructuredOutputManager | None,
        mm_processor: MultiModalProcessor | None = None,
    ):
        self.runner = runner
        self.mm_processor = mm_processor
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.structured_outputs = structured_outputs
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.lora_requests = LoRARequestChecker(runner)

    def tokenize(self, prompt: ParsedPrompt) -> list[int]:
        """The prompt's token ids: its text encoded, or its ids checked against the vocabulary."""
        if prompt.token_ids is None:
            if self.tokenizer is None:
                raise ValueError(
                    "This engine has no tokenizer (skip_tokenizer_init=True): give the prompt as token ids."
                )
            return list(self.tokenizer.encode(prompt.text))
        vocab = self.runner.vocab_size
        bad = [t for t in prompt.token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"Prompt token ids {bad[:5]} are outside the model's vocabulary: ids must be in [0, {vocab})."
            )
        return prompt.token_ids

    def process_multimodal(
        self, prompt: ParsedPrompt, token_ids: list[int]
    ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """The token ids with the prompt's image placeholders expanded, and its images' features; ValueError
        if the images cannot be read, are too many or too large, or the model takes none."""
        if not prompt.multi_modal_data:
            return token_ids, []
        if self.mm_processor is None:
            raise ValueError(
                "The prompt has multi_modal_data, but this model takes no images: serve a vision-language model "
                "(Qwen2-VL, Qwen2.5-VL), or send text only."
            )
        token_ids, features = self.mm_processor.process(token_ids, prompt.multi_modal_data)
        most = self.runner.max_image_embeds
        for i, feature in enumerate(features):
            if most is not None and feature.num_embeds > most:
                raise ValueError(
                    f"Image {i} of the prompt takes {feature.num_embeds} tokens, more than one image may "
                    f"({most}: the least of max_model_len, the encoder budget and the encoder cache); send a smaller "
                    "image, or raise max_model_len or SchedulerConfig.encoder_cache_size."
                )
        return token_ids, features

    def discard(self, requests: list[Request]) -> None:
        """Forget requests made and never queued (their grammars)."""
        if self.structured_outputs is not None:
            for request in requests:
                self.structured_outputs.remove_request(request.request_id)

    def make_requests(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        mm_features: list[MultiModalFeatureSpec] | None = None,
    ) -> list[Request]:
        """The ``n`` requests of a prompt, with ``lora_request``'s adapter (None: the base model) and its
        images' ``mm_features``, their grammars registered; ``ValueError`` if it cannot run."""
        self._validate(token_ids, params, mm_features or [])
        if lora_request is not None:
            self.lora_requests.check(lora_request)
        params = self._with_token_lists(params)
        self.runner.check_sampling_params(params)
        requests = self._fan_out(request_id, token_ids, params, lora_request, mm_features or [])
        self._add_grammars(requests, params)
        return requests

    def _validate(self, token_ids: list[int], params: SamplingParams, mm_features: list[MultiModalFeatureSpec]) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}.")
        params._validate()  # fields may have been changed after construction
        if not token_ids:
            raise ValueError("The prompt is empty; give at least one token.")
        max_model_len = self.runner.max_model_len
        if len(token_ids) > max_model_len:
            images = sum(f.num_embeds for f in mm_features)
            of_images = f" ({images} of them its images' placeholders)" if images else ""
            raise ValueError(
                f"The prompt has {len(token_ids)} tokens{of_images}, more than max_model_len ({max_model_len})."
            )
        scheduler_config = self.scheduler.config
        if not scheduler_config.enable_chunked_prefill and len(token_ids) > scheduler_config.max_num_batched_tokens:
            raise ValueError(
                f"The prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                f"({scheduler_config.max_num_batched_tokens}) with chunked prefill off: it could never be scheduled."
            )
        manager = self.scheduler.kv_cache_manager
        needed = manager.blocks_to_hold(
            len(token_ids) + 1 + self.scheduler.num_lookahead_tokens, scheduler_config.max_num_batched_tokens
        )
        if needed > manager.num_usable_blocks:
            raise ValueError(
                f"The prompt needs {needed} KV cache blocks, more than the whole cache holds "
                f"({manager.num_usable_blocks}); shorten it or give the cache more memory."
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer to detect stop strings.")

    def _with_token_lists(self, params: SamplingParams) -> SamplingParams:
        """Add what the runner needs as token ids: min_tokens' stop ids and the bad words."""
        stop_ids = list(params.stop_token_ids or ())
        if self.eos_token_id is not None and not params.ignore_eos:
            stop_ids.append(self.eos_token_id)
        bad_words = []
        for word in params.bad_words or []:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.bad_words needs a tokenizer.")
            # As vLLM: the word as it is and after a space, without special tokens.
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in bad_words:
                    bad_words.append(ids)
        return dataclasses.replace(params, all_stop_token_ids=stop_ids, bad_words_token_ids=bad_words)

    def _fan_out(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None,
        mm_features: list[MultiModalFeatureSpec],
    ) -> list[Request]:
        """One request per sequence; with ``n > 1`` child i is ``f"{i}_{request_id}"`` and samples with seed + i."""
        arrival = time.monotonic()
        # Children differ only in their seeds, which decide nothing here.
        multi_step_ok = self.scheduler.config.num_scheduler_steps > 1 and self._runs_to_length(params)
        requests = []
        for index in range(params.n):
            child_id, child_params = request_id, params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_id, child_params = f"{index}_{request_id}", dataclasses.replace(params, n=1, seed=seed)
            requests.append(
                Request(
                    child_id,
                    token_ids,
                    child_params,
                    self.eos_token_id,
                    arrival_time=arrival,
                    multi_step_ok=multi_step_ok,
                    lora_request=lora_request,
                    mm_features=mm_features,
                )
            )
        return requests

    def _runs_to_length(self, params: SamplingParams) -> bool:
        """Whether a request can end only at its length limit and samples plainly: several decode
        steps per round take it. ``params`` carries its stop ids (EOS included unless ignored)."""
        return (
            not params.all_stop_token_ids
            and not params.stop
            and params.structured_outputs is None
            and self.runner.samples_plainly(params)
        )

    def _add_grammars(self, requests: list[Request], params: SamplingParams) -> None:
        """One grammar matcher per request; none is left behind if one fails."""
        if params.structured_outputs is None:
            return
        if self.structured_outputs is None:
            raise ValueError("SamplingParams.structured_outputs needs a tokenizer.")
        added = []
        try:
            for request in requests:
                self.structured_outputs.add_request(request.request_id, params.structured_outputs)
                added.append(request.request_id)
        except ValueError:
            for req_id in added:
                self.structured_outputs.remove_request(req_id)
            raise
