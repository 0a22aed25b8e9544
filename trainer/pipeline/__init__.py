"""Pipeline parallelism: the split (``split``, ``search``), its prices (``cost``), the replay of a schedule
(``simulate``), calibration from a timed run (``calibrate``) and the stages and schedule at run time (``runtime``)."""
