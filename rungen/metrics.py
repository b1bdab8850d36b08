"""The server's counters and histograms, rendered as Prometheus text for GET /metrics; the model thread counts
tokens and times into them."""

import collections
import threading


class Metrics:
    """Counters and histograms for /metrics (Prometheus text), shared by the server and the model thread."""

    TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
    TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = collections.Counter()  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.reused_tokens = 0  # prompt tokens whose keys/values came from the prefix cache
        self.gave_way = 0  # requests whose rows gave way out of GPU memory (to go on later)
        self.ttft = [0] * (len(self.TTFT_BUCKETS) + 1), [0.0, 0]
        self.tpot = [0] * (len(self.TPOT_BUCKETS) + 1), [0.0, 0]

    def observe(self, histogram, buckets, value):
        counts, total = histogram
        with self.lock:
            counts[next((i for i, bound in enumerate(buckets) if value <= bound), len(buckets))] += 1
            total[0] += value
            total[1] += 1

    def count_request(self, endpoint, status):
        with self.lock:
            self.requests[endpoint, status] += 1

    def add_tokens(self, prompt=0, generated=0, reused=0):
        with self.lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generated
            self.reused_tokens += reused

    def count_gave_way(self, requests=1):
        with self.lock:
            self.gave_way += requests

    def render(self, queue_depth, running):
        lines = ["# HELP rungen_requests_total HTTP requests by endpoint and status.",
                 "# TYPE rungen_requests_total counter"]
        with self.lock:
            for (endpoint, status), count in sorted(self.requests.items()):
                lines.append(f'rungen_requests_total{{endpoint="{endpoint}",status="{status}"}} {count}')
            lines += ["# HELP rungen_prompt_tokens_total Prompt tokens prefilled.",
                      "# TYPE rungen_prompt_tokens_total counter", f"rungen_prompt_tokens_total {self.prompt_tokens}",
                      "# HELP rungen_generation_tokens_total Tokens generated.",
                      "# TYPE rungen_generation_tokens_total counter",
                      f"rungen_generation_tokens_total {self.generation_tokens}",
                      "# HELP rungen_prefix_cache_tokens_total Prompt tokens taken from the prefix cache.",
                      "# TYPE rungen_prefix_cache_tokens_total counter",
                      f"rungen_prefix_cache_tokens_total {self.reused_tokens}",
                      "# HELP rungen_gave_way_total Requests that gave way when a step or a join ran out of GPU "
                      "memory, to go on later (their prompt and tokens prefilled again, counted again).",
                      "# TYPE rungen_gave_way_total counter",
                      f"rungen_gave_way_total {self.gave_way}",
                      "# HELP rungen_queue_depth Requests waiting for a batch slot.",
                      "# TYPE rungen_queue_depth gauge",
                      f"rungen_queue_depth {queue_depth}",
                      "# HELP rungen_running_rows Sequences decoding in the batch.",
                      "# TYPE rungen_running_rows gauge",
                      f"rungen_running_rows {running}"]
            for name, help_text, buckets, (counts, total) in (
                ("rungen_time_to_first_token_seconds", "From arrival to the first generated token.",
                 self.TTFT_BUCKETS, self.ttft),
                ("rungen_time_per_output_token_seconds", "Between consecutive tokens of a sequence.",
                 self.TPOT_BUCKETS, self.tpot),
            ):
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
                cumulative = 0
                for bound, count in zip((*buckets, "+Inf"), counts):
                    cumulative += count
                    lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
                lines += [f"{name}_sum {total[0]:.6f}", f"{name}_count {total[1]}"]
        return "\n".join(lines) + "\n"
