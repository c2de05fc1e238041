"""The rollout engine: models, schedules, step kernels, capture, replay (torch + diffusers).

transformers announces, once per image-processor class, that it "requires torchvision (not
installed)" and falls back to its PIL backend when diffusers' pipeline modules import those
classes. sigmaflight's models never process images with them, so that one notice is dropped on
transformers' own logger; every other transformers message is left alone.
"""

import logging


class _NoTorchvisionFallbackNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed)" not in record.getMessage()


logging.getLogger("transformers.utils.import_utils").addFilter(_NoTorchvisionFallbackNotice())
