"""The benchmark harness: pgqueue beside Redis, RabbitMQ and Kombu's SQLAlchemy transport.

``python -m benchmarks --help`` from the repository root; see README.md in this folder.

Modules: ``cli`` (command line), ``config`` (settings, sizes, the run context),
``peers`` (the brokers, their queues, clean-up), ``workers`` (``celery worker``
subprocesses), ``kombu_runs`` and ``celery_runs`` (the figures every broker gets),
``probes_idle``, ``probes_claim``, ``probes_bulk``, ``probes_eta`` (the others),
``orchestrate`` (the order of the runs), ``figures`` and ``report`` (the table and ratios);
``bench_app`` is the workers' Celery app and ``pgproxy`` the counting proxy.
"""
