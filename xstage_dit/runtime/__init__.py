"""What serving, the benchmark and the CLI share above the engine: the request type and the pipeline-argument
rule (`generation`), the image and video encoders (`png`, `mp4`) and process tuning (`malloc_heap`: freed memory
kept mapped; `gc_pauses`: the heap frozen out of the garbage collector's way, its pauses counted)."""
