"""Data parallelism for the plain optimizers (SGD, Adam, AdamW) under horovodrun.

K-FAC averages gradients over ranks itself, before preconditioning. Keras optimizers do
not, and Horovod's Keras wrapper fails under Keras 3 (horovod#4290), so the trainer
gives them the same one fused allreduce through the project's communicator. Under a
tf.distribute strategy Keras's optimizers sum the replicas' gradients themselves (of a
loss Keras scaled by 1/replicas): nothing to add there.
"""

from tfkfac import distributed


def averaging(optimizer_class, communicator):
    """Returns `optimizer_class` itself on one rank or under a tf.distribute strategy, else
    a subclass whose `apply` first averages the gradients over all ranks in one grouped
    allreduce."""
    if communicator.size == 1 or isinstance(communicator, distributed.StrategyCommunicator):
        return optimizer_class

    class GradientAveraging(optimizer_class):
        def apply(self, grads, trainable_variables=None):
            grads = communicator.grouped_allreduce_mean(list(grads), category="gradients")
            return super().apply(grads, trainable_variables)

    GradientAveraging.__name__ = f"GradientAveraging{optimizer_class.__name__}"
    return GradientAveraging
