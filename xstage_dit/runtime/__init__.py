"""What serving, the benchmark and the CLI share above the engine: the request type and the pipeline-argument
rule (`generation`), the image and video encoders (`png`, `mp4`) and process tuning (`malloc_heap`)."""
