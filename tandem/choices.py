"""The values an engine option may take, kept free of torch so that the CLI builds its parser
(and `tandem --help` answers) without loading it; tandem.config validates against the same tuples."""

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # CacheConfig.cache_dtype
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # ModelConfig.logprobs_mode
SCHEDULING_POLICIES = ("fcfs", "priority")  # SchedulerConfig.policy
SPEC_DECODE_METRICS_LEVELS = ("none", "summary", "detailed")  # EngineConfig.per_request_spec_decode_metrics
CPU_MATMULS = ("auto", "avx512bf16", "avx512", "avx2", "fbgemm", "torch")  # LLM(cpu_matmul=...): tandem.layers.cpu_linear
