"""vLLM's legacy (V0) block layer (``vllm/core/``): blocks, allocators that count references, share
prefixes and copy on write, and the block table that maps a sequence's tokens onto them.

Read in this order: ``interfaces`` (what a block and an allocator promise), ``common`` (the
reference counter, the copy-on-write log, the object pool), then the allocators and the table,
then the block manager and the FCFS scheduler that drives it (``scheduler``, ``records``,
``workload``).
"""
