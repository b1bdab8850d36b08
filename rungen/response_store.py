"""The store of /v1/responses: responses kept for previous_response_id and read back by GET, DELETE and
input_items (docs/server.md#the-store), in memory, the least recently used dropped first."""

import collections
import dataclasses
import uuid

from .openai_api import APIError, excerpt

# Responses kept for previous_response_id; a chain of responses shares its conversation's items.
MAX_STORED_RESPONSES = 256
# An input item given without an id gets one, as OpenAI's input_items lists it.
ITEM_PREFIXES = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


def store_of(service):
    """The service's store of responses (made on first use)."""
    store = getattr(service, "response_store", None)
    if store is None:
        store = service.response_store = Store()
    return store


@dataclasses.dataclass
class Stored:
    response: dict  # the response object, as GET /v1/responses/{id} returns it
    input: list  # this request's input items (with ids), as its input_items lists them
    items: list  # the whole conversation's items (earlier responses', its input, its output)


class Store:
    """Stored responses, least recently used out: id -> Stored."""

    def __init__(self, limit=MAX_STORED_RESPONSES):
        self.limit, self.held = limit, collections.OrderedDict()

    def put(self, response_id, stored):
        self.held[response_id] = stored
        self.held.move_to_end(response_id)
        while len(self.held) > self.limit:
            self.held.popitem(last=False)

    def get(self, response_id):
        found = self.held.get(response_id)
        if found is not None:
            self.held.move_to_end(response_id)
        return found

    def delete(self, response_id):
        return self.held.pop(response_id, None) is not None


def not_found(response_id):
    return APIError(f"No response found with id {excerpt(response_id)}.", None, status=404)


def stored_or_404(service, response_id):
    found = store_of(service).get(response_id)
    if found is None:
        raise not_found(response_id)
    return found


def delete(service, response_id):
    if not store_of(service).delete(response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def input_items(service, response_id, query):
    """GET /v1/responses/{id}/input_items: its request's input items, newest first unless order=asc, a page of
    `limit` after the item `after`."""
    check_query(query, ("limit", "order", "after", "include"))
    items = list(stored_or_404(service, response_id).input)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(f"order must be asc or desc, got {excerpt(order)}", "order")
    if order == "desc":
        items.reverse()
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise APIError(f"limit must be an integer from 1 to 100, got {excerpt(limit)}", "limit")
    if "after" in query:
        ids = [item["id"] for item in items]
        if query["after"] not in ids:
            raise APIError(f"after: no input item {excerpt(query['after'])} in this response", "after")
        items = items[ids.index(query["after"]) + 1:]
    page = items[: int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


def check_query(query, allowed):
    for name in query:
        if name not in allowed:
            raise APIError(f"{name} is not supported by this server", name)


def listed(item):
    """An input item as input_items lists it: with an id, a type, a message's text as parts."""
    kind = item.get("type", "message")
    item = dict(item, type=kind, id=item.get("id") or ITEM_PREFIXES.get(kind, "msg_") + uuid.uuid4().hex)
    if kind == "message" and isinstance(item["content"], str):
        part = {"type": "output_text", "text": item["content"], "annotations": []} if item["role"] == "assistant" \
            else {"type": "input_text", "text": item["content"]}
        item = dict(item, content=[part], status=item.get("status") or "completed")
    return item
