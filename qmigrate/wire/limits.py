"""The wire's numbers: the protocol version, the size limits a decoder enforces, and the
bounds of a request's fields (ingest refuses a request past them with its own error before
sending it; the codec refuses a message past them)."""

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20  # control and token messages; KV payloads travel as extra frames
MAX_ARRAY_LEN = 1 << 20
MAX_ID = (1 << 31) - 1
MAX_STR = 1 << 16            # characters in any string field
CONTINUE = -1
ROUTE_STDOUT = 0   # a request's text is printed by the detokenizer
ROUTE_INGEST = 1   # a request's text goes back to the ingest node that took it (HTTP)
ROUTE_INGEST_IDS = 2   # as ROUTE_INGEST, with each step's token ids beside its text (return_token_ids)
INGEST_ROUTES = (ROUTE_INGEST, ROUTE_INGEST_IDS)
MAX_REPLY_TEXT = 1 << 16
# One Submit carries up to this many prompts, and this many ids in all (16 MiB): a burst
# reaches the router in a few acknowledged messages, so its first leases are full ones.
SUBMIT_MAX_SEQS = 512
SUBMIT_MAX_IDS = 1 << 22
# A request's bounds on the wire: the codec refuses a SeqSpec past them, and ingest refuses
# such a request with its own error before it is sent (ingest.prompts uses these names).
MAX_NEW_TOKENS = 1 << 30
MAX_TOP_K = 1 << 30
MAX_TEMPERATURE = 2.0     # OpenAI's bound, on every input path (HTTP, stdin JSONL, a topology's default)
MAX_SEED = (1 << 63) - 1
MAX_STOP_SEQS = 64         # stop sequences of one request
MAX_STOP_LEN = 64          # token ids of one stop sequence (and of the EOS list)
MAX_REQ_ID = 256           # characters of a request id
MAX_CACHE_SALT = 256       # characters of a request's cache_salt
MAX_PENALTY = 2.0          # presence and frequency penalties are in [-2, 2] (OpenAI's bounds)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0   # 1 is off
MAX_LOGIT_BIAS = 1024      # entries of a request's logit_bias
MAX_BIAS = 100.0           # a logit_bias value is in [-100, 100] (OpenAI's bounds)
# A worker's KV tiers, as StepResult.tier_stats carries them: blocks held and hits (blocks a
# prompt started on) per tier, and bytes copied into the host tier and back out of it
TIER_STATS = ("gpu_blocks", "gpu_hits", "host_blocks", "host_hits", "host_bytes_in", "host_bytes_out")
MAX_NOTE = 1024            # characters of a request's note and of an error message
# One HTTP request fans out into one engine request per choice: `n` per prompt (at most
# MAX_N), prompts × n at most MAX_CHOICES (one Submit's worth), checked before any is queued.
MAX_N = 128
# Log probabilities: the sampled token's and up to MAX_LOGPROBS alternatives' (vLLM's max_logprobs)
MAX_LOGPROBS = 20
MAX_CHOICES = SUBMIT_MAX_SEQS
