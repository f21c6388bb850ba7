"""The engine: the plan tables, the decode step, CUDA graphs, prefill, the scheduler and its
protocol, the prefix cache, the engine process, LanguageModel and the Backbone."""
