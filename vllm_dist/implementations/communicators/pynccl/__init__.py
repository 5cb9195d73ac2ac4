"""PyNCCL: a DeviceCommunicator that drives libnccl directly through ctypes.

``library`` finds, loads and binds libnccl (importable without torch.cuda or a GPU);
``communicator`` holds ``PyNcclCommunicator``, registered as ``CommunicatorType.PYNCCL``. This
package imports neither eagerly, so resolving another backend never loads NCCL.
"""
