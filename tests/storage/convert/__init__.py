import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')  # the HF reference models are built from configs, never downloaded
