resource "aws_ecr_repository" "gateway" {
  name                 = coalesce(var.ecr_repository_name, var.name)
  image_tag_mutability = var.ecr_immutable_tags ? "IMMUTABLE" : "MUTABLE"

  image_scanning_configuration {
    scan_on_push = true
  }

  encryption_configuration {
    encryption_type = "AES256"
  }
}

resource "aws_ecr_lifecycle_policy" "gateway" {
  repository = aws_ecr_repository.gateway.name

  # CUDA images are several GB each: expire what nothing can run any more.
  policy = jsonencode({
    rules = [
      {
        rulePriority = 1
        description  = "Untagged images (superseded pushes, failed builds) after a day"
        selection = {
          tagStatus   = "untagged"
          countType   = "sinceImagePushed"
          countUnit   = "days"
          countNumber = 1
        }
        action = { type = "expire" }
      },
      {
        rulePriority = 2
        description  = "Keep the ${var.ecr_keep_images} most recent images (rollback targets)"
        selection = {
          tagStatus   = "any"
          countType   = "imageCountMoreThan"
          countNumber = var.ecr_keep_images
        }
        action = { type = "expire" }
      },
    ]
  })
}
