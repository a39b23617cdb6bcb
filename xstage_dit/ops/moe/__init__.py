"""Expert-parallel MoE: dispatch, the fused expert MLP whose Linear-2 epilogue writes the combine rows
with remote stores, and the combine-reduce (`combine`); the Triton kernel (`kernel`)."""
