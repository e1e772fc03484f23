terraform {
  required_version = ">= 1.5"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # A 5.x release with managed_draining on capacity providers and metric-math target
      # tracking (customized_metric_specification.metrics); validated against 5.100.0.
      version = ">= 5.40, < 6.0"
    }
  }
}

provider "aws" {
  region = var.region

  default_tags {
    tags = merge({ Project = var.name, ManagedBy = "terraform" }, var.tags)
  }
}
