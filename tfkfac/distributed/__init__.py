"""Distributed K-FAC: communicators (Horovod, tf.distribute), symmetric packing, the
float21 wire format, owner assignment, exchanges.

Nothing here imports Horovod until a Horovod communicator is asked for.
"""

from tfkfac.distributed.assignment import eigen_cost, lpt_assignment
from tfkfac.distributed.base import CATEGORIES, Communicator, SingleProcess
from tfkfac.distributed.exchange import (allreduce_symmetric, gather_from_owners,
                                         gathered_bytes)
from tfkfac.distributed.factory import (communicator_for, get_communicator,
                                        launched_world_size)
from tfkfac.distributed.strategy_comm import StrategyCommunicator, check_model_strategy
from tfkfac.distributed.packing import (pack_upper_triangles, packed_size,
                                        unpack_upper_triangles, wire_dtype)
