"""accelstack NR1 CNI plugin: moves the network interface of the NR1 module a pod was given into the pod.

Kept free of imports: the plugin is exec'd per attachment and every import is start-up latency.
"""
