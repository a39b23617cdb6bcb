"""Communication: process groups, symmetric-memory buffers and pointer tables (`distributed`), and the
launcher of N local ranks (`launcher`)."""
