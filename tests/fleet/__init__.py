"""Fleet engines (kstatus, Argo CD) reading the InferenceDeployment status."""
