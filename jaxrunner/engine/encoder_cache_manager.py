"""The encoder cache's bookkeeping on the scheduler's side, as vLLM's ``EncoderCacheManager``.

The runner keeps each image's encoder output (one embedding per placeholder
token) on the device until the scheduler tells it to drop it; this manager
decides which outputs exist there, in embeddings of room. An entry is keyed by
the image's content hash and referenced by the requests that still need it (a
request needs an image until its computed tokens pass the image's last
placeholder). An entry nobody references stays cached, so a later request with
the same image finds it, until room is needed: then the least recently freed
go first, and their hashes reach the runner in the next ``SchedulerOutput``'s
``free_encoder_mm_hashes``.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxrunner.engine.request import Request


class EncoderCacheManager:
    """Which images' encoder outputs the runner holds, who needs them, and what may be dropped."""

    def __init__(self, cache_size: int):
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        # Free slots plus those of entries nobody references (droppable when room is needed).
        self.num_freeable_slots = cache_size
        # Content hash -> ids of the requests that reference the entry.
        self.cached: dict[str, set[str]] = {}
        self.sizes: dict[str, int] = {}  # content hash -> the entry's embeddings
        # Entries nobody references, least recently freed first, with their sizes.
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.freed: list[str] = []

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """Whether the request's item ``input_id`` is cached; if so, the request now references it."""
        mm_hash = request.mm_features[input_id].identifier
        holders = self.cached.get(mm_hash)
        if holders is None:
            return False
        if not holders:
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        holders.add(request.request_id)
        return True

    def can_allocate(self, request: Request, input_id: int, compute_budget: int, num_embeds_to_schedule: int) -> bool:
        """Whether the item fits this step's encoder budget and the cache beside ``num_embeds_to_schedule``
        embeddings already scheduled; drops unreferenced entries (recorded in ``freed``) to make room."""
        num_embeds = request.mm_features[input_id].num_embeds
        if num_embeds > compute_budget:
            return False
        needed = num_embeds + num_embeds_to_schedule
        if needed > self.num_freeable_slots:
            return False
        while needed > self.num_free_slots:
            mm_hash, size = self.freeable.popitem(last=False)
            del self.cached[mm_hash], self.sizes[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += size
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        """Make room for the item's encoder output, referenced by the request (after ``can_allocate``)."""
        feature = request.mm_features[input_id]
        self.cached.setdefault(feature.identifier, set()).add(request.request_id)
        self.sizes[feature.identifier] = feature.num_embeds
        self.num_free_slots -= feature.num_embeds
        self.num_freeable_slots -= feature.num_embeds

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """The request no longer needs the item; an entry nobody needs becomes freeable."""
        feature = request.mm_features[input_id]
        holders = self.cached.get(feature.identifier)
        if holders is None or request.request_id not in holders:
            return
        holders.discard(request.request_id)
        if not holders:
            self.freeable[feature.identifier] = feature.num_embeds
            self.num_freeable_slots += feature.num_embeds

    def free(self, request: Request) -> None:
        """Drop the request's references to all its items (it finished or was preempted)."""
        for input_id in range(len(request.mm_features)):
            self.free_encoder_input(request, input_id)

    def get_freed_mm_hashes(self) -> list[str]:
        """The entries dropped since the last call, for the runner to free."""
        freed, self.freed = self.freed, []
        return freed

    def reset(self) -> None:
        """Forget every entry, as the runner does when the engine recovers from a step cut short."""
        self.cached.clear()
        self.sizes.clear()
        self.freeable.clear()
        self.freed = []
        self.num_free_slots = self.num_freeable_slots = self.cache_size

    @property
    def num_referenced_slots(self) -> int:
        """Slots of entries some request still references: zero once every request has finished."""
        return self.cache_size - self.num_freeable_slots
