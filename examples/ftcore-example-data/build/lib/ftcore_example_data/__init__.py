"""An example third-party ftcore plugin: the ``tsv`` data source and the ``turns`` chat template.

* :mod:`.tsv`: tab-separated files with a header row, built on the public base
  ``ftcore_plugins.data.base.FileSource``, so it gets ``format``/``columns``, ``on_error``
  (with exact line numbers), ``limit``, the filters, ``dedup``, ``validation`` splits and
  the data report without any code of its own.
* :mod:`.turns`: a chat template with its own special tokens (``<|turn|>`` and the
  end-of-turn ``<|end|>``), added through ``ftcore_plugins.common.tokens.add_special_tokens``
  so that their embeddings are trained under LoRA and generation stops at ``<|end|>``.

Nothing heavy is imported at import time: ``ftcore plugins`` and ``ftcore validate`` stay fast.
"""

__version__ = "0.1.0"

# The entry point names this module: the hooks defined in the submodules are registered by importing them here.
from .tsv import TsvSource, register_data_sources  # noqa: E402,F401
from .turns import TurnsTemplate, register_chat_templates  # noqa: E402,F401
