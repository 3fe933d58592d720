"""The operator's commands that talk to a running gateway over HTTP: ``kvserve experiment report``
(:mod:`deployments.operator.experiment_report`) and ``kvserve warm`` (:mod:`deployments.operator.warm`)."""
