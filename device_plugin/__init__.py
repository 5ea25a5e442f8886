"""accelstack device plugins: NVIDIA GPUs (NVML) and NeuReality NR1 modules (PCI/sysfs) on the kubelet's
device-plugin API v1beta1."""
