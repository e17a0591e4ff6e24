"""DeepSpeed's own checkpoints, read and written without DeepSpeed: its layout read by content
(``layout.py``, through an unpickler that maps DeepSpeed's few classes to records and refuses
any other, ``pickles.py``), resumed into an engine of any world size and ZeRO stage
(``load.py``), consolidated into weights files one tensor at a time as DeepSpeed's
``zero_to_fp32.py`` gathers them (``weights.py``)."""
