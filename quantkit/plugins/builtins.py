"""Imports every built-in plugin module so that each registers itself under its stable name."""

import quantkit.algorithms.awq  # noqa: F401
import quantkit.algorithms.fp8  # noqa: F401
import quantkit.algorithms.gptq  # noqa: F401
import quantkit.algorithms.kv_cache  # noqa: F401
import quantkit.algorithms.rotate  # noqa: F401
import quantkit.algorithms.rtn  # noqa: F401
import quantkit.algorithms.smoothquant  # noqa: F401
import quantkit.arch.builtin  # noqa: F401
import quantkit.formats.float_quantized  # noqa: F401
import quantkit.formats.int_quantized  # noqa: F401
import quantkit.formats.microscaled  # noqa: F401
import quantkit.formats.pack_quantized  # noqa: F401
import quantkit.formats.ggml_blocks  # noqa: F401
