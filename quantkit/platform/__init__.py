"""What quantkit runs on: devices, the compute dtype, memory and the allocator, paths, crash reports, transformers differences."""
