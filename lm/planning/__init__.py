"""Planning a run for its hardware: ahead-of-time compiles for TPU slices (`compile`) and the mesh, remat and
microbatch search with a roofline step time (`plan`)."""
